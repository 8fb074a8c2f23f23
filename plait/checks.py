"""Every check of a configuration that can be made before a worker starts (`validate`): the model,
layout and training keys (`checks_layout.py`, with `checks_train.py` and `checks_hf.py`), then
what the run reads from disk (`checks_files.py`). Each raises `ConfigError(field, fix)`; the CLI
turns it into exit status 2 and one line."""

from __future__ import annotations

from plait.checks_files import check_checkpoint, check_data
from plait.checks_layout import check_layout
from plait.config import Config
from plait.mesh import ParallelDims


def validate(cfg: Config, world_size: int) -> ParallelDims:
    """Check everything that can be checked before launch; return the resolved mesh degrees."""
    dims = check_layout(cfg, world_size)
    check_data(cfg.data, cfg.model.args())
    check_checkpoint(cfg)
    return dims
