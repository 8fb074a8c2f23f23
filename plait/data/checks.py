"""The check of the corpora a run reads (`data`), made before a worker starts: the keys, then
whether each source is there; `plait.train.checks.validate` runs it after the layout's. Raises
`ConfigError(field, fix)`. Reads the file system only (a refusal imports no torch)."""

from __future__ import annotations

import re
from pathlib import Path

from plait.config.schema import ConfigError, DataConfig, folder_name
from plait.model.args import ModelArgs


def check_data(data: DataConfig, args: ModelArgs) -> None:
    if not 1 <= data.seq_len <= args.max_seq_len:
        raise ConfigError(
            "data.seq_len",
            f"must be in [1, model.max_seq_len={args.max_seq_len}], got {data.seq_len}",
        )
    if not 0 < data.val_fraction < 1:
        raise ConfigError("data.val_fraction", f"must be in (0, 1), got {data.val_fraction}")
    if data.max_bytes < 0:
        raise ConfigError("data.max_bytes", f"must be >= 0 (0: all of data.source), got "
                          f"{data.max_bytes}")
    if data.source != "stdlib" and not Path(data.source).exists():
        raise ConfigError("data.source", f"no such file or folder '{data.source}'; or use 'stdlib'")
    if data.sources:
        _check_sources(data)


def _check_sources(data: DataConfig) -> None:
    """`data.sources`: tables of a path, a weight and maybe a name, the names distinct."""
    if data.source != "stdlib":
        raise ConfigError("data.sources", "a mixture replaces data.source: set one of them")
    if data.max_bytes:
        raise ConfigError("data.max_bytes", "cuts data.source; a mixture's sources are whole "
                          "(set it to 0, or weigh the sources)")
    names = set()
    for i, entry in enumerate(data.sources):
        key = f"data.sources[{i}]"
        unknown = sorted(set(entry) - {"path", "weight", "name"})
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}", "unknown key; a source has path, weight "
                              "and name")
        path, weight = entry.get("path"), entry.get("weight")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{key}.path", "the folder plait data prepare wrote, as a string")
        # Bounded so that any number of them sums to a finite total (the draw divides by it).
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not 0 < weight <= 1e6:
            raise ConfigError(f"{key}.weight", f"a number in (0, 1e6] (the weights need not sum "
                              f"to 1), got {weight!r}")
        name = entry.get("name", folder_name(path))
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ConfigError(f"{key}.name", f"letters, digits, '_', '.' or '-' (it names the "
                              f"source's metrics, epoch/<name>), got {name!r}")
        if name in names:
            raise ConfigError(f"{key}.name", f"'{name}' names two sources; give each its own "
                              "name")
        names.add(name)
