"""The checks of what a run reads from disk, its corpora (`data`) and the checkpoint it resumes
(`checkpoint`), made before a worker starts; `plait.checks.validate` calls them after the
layout's. Each raises `ConfigError(field, fix)`. They read files, and import the data and
checkpoint packages that know them (in the functions: a refusal of anything else needs neither).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from plait.config import Config, ConfigError, DataConfig, folder_name, model_section
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


def check_checkpoint(cfg: Config) -> None:
    ck = cfg.checkpoint
    if ck.every < 0:
        raise ConfigError("checkpoint.every", f"must be >= 0 steps (0: at the end), got {ck.every}")
    if ck.keep < 1:
        raise ConfigError("checkpoint.keep", f"must be >= 1, got {ck.keep}")
    if ck.every and not ck.dir:
        raise ConfigError("checkpoint.every", "saving needs checkpoint.dir, a folder to save in")
    if ck.dir:
        where = Path(ck.dir)
        while not where.exists() and where != where.parent:
            where = where.parent
        if not where.is_dir() or not os.access(where, os.W_OK):
            raise ConfigError("checkpoint.dir", f"cannot write in {where}; choose another folder")
    from plait.checkpoint import find

    source = find(ck.resume, ck.dir)  # a path given as `resume` is looked in alone
    if ck.resume not in ("auto", "never") and source is None:
        raise ConfigError("checkpoint.resume", f"no complete checkpoint at {ck.resume}; give a "
                          "checkpoint folder (with COMPLETE) or a folder of them, 'auto' or "
                          "'never'")
    if source is None:
        return
    from plait.checkpoint import BadMeta, read_meta

    try:  # plait.json first, read without torch: a checkpoint of another model is refused fast
        held = model_section(dict(read_meta(source, model=True)["config"]["model"]))
    except BadMeta as e:
        raise ConfigError("checkpoint.resume", f"{e}; resume from a checkpoint you trust, or set "
                          "checkpoint.resume='never'") from None
    ours = _weights_signature(cfg.model.args())
    differ = {k: v for k, v in _weights_signature(held.args()).items() if ours[k] != v}
    if differ:
        key, value = next(iter(differ.items()))
        raise ConfigError("checkpoint.resume", f"{source} holds a model with {key}={value}, "
                          f"this run's has {key}={ours[key]}; resume with the same model "
                          "settings, or set checkpoint.resume='never'")
    # Imported here: torch.distributed.checkpoint takes seconds to import, which every refusal
    # and every command that validates a configuration would pay otherwise.
    from plait.checkpoint.metadata import UnsafeCheckpoint, check_checkpoint

    try:
        check_checkpoint(source)
    except (UnsafeCheckpoint, BadMeta) as e:
        raise ConfigError("checkpoint.resume", f"{e}; resume from a checkpoint you trust, "
                          "or set checkpoint.resume='never'") from None


def _weights_signature(args: ModelArgs) -> dict:
    """What a checkpoint's weights fix: their shapes, and the numbers the forward uses them with."""
    keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "norm_eps",
            "rope_theta")
    return {k: getattr(args, k) for k in keys}
