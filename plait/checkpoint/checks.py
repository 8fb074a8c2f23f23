"""The check of the checkpoint a run saves to and resumes from (`checkpoint`), made before a worker
starts; `plait.train.checks.validate` runs it after the layout's. Raises `ConfigError(field, fix)`.
It reads plait.json without torch; the tensors' metadata (torch.distributed.checkpoint) is imported
only when there is a checkpoint to read."""

from __future__ import annotations

import os
from pathlib import Path

from plait.checkpoint import BadMeta, find, read_meta
from plait.config.schema import Config, ConfigError, model_section
from plait.model.shape import Shape


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
    source = find(ck.resume, ck.dir)  # a path given as `resume` is looked in alone
    if ck.resume not in ("auto", "never") and source is None:
        raise ConfigError("checkpoint.resume", f"no complete checkpoint at {ck.resume}; give a "
                          "checkpoint folder (with COMPLETE) or a folder of them, 'auto' or "
                          "'never'")
    if source is None:
        return
    try:  # plait.json first, read without torch: a checkpoint of another model is refused fast
        held = model_section(dict(read_meta(source, model=True)["config"]["model"]))
    except BadMeta as e:
        raise ConfigError("checkpoint.resume", f"{e}; resume from a checkpoint you trust, or set "
                          "checkpoint.resume='never'") from None
    ours = _weights_signature(cfg.model.shape())
    differ = {k: v for k, v in _weights_signature(held.shape()).items() if ours[k] != v}
    if differ:
        key, value = next(iter(differ.items()))
        raise ConfigError("checkpoint.resume", f"{source} holds a model with {key}={value}, "
                          f"this run's has {key}={ours[key]}; resume with the same model "
                          "settings, or set checkpoint.resume='never'")
    # Imported here: torch.distributed.checkpoint takes seconds to import, which every refusal
    # and every command that validates a configuration would pay otherwise.
    from plait.checkpoint import metadata

    try:
        metadata.check_checkpoint(source)
    except (metadata.UnsafeCheckpoint, BadMeta) as e:
        raise ConfigError("checkpoint.resume", f"{e}; resume from a checkpoint you trust, "
                          "or set checkpoint.resume='never'") from None


def _weights_signature(shape: Shape) -> dict:
    """What a checkpoint's weights fix: their shapes, and the numbers the forward uses them with."""
    keys = ("hidden", "layers", "heads", "kv_heads", "head_dim", "vocab", "ffn", "experts",
            "norm_eps", "rope_theta")
    return {k: getattr(shape, k) for k in keys}
