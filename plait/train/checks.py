"""Every check of a run that can be made before a worker starts (`validate`): the model, layout
and training keys (`config/checks_layout.py`, with `config/checks_train.py` and
`config/checks_hf.py`), then what the run reads from disk: its corpora (`data/checks.py`) and its
checkpoint (`checkpoint/checks.py`). Each raises `ConfigError(field, fix)`; the CLI turns it into
exit status 2 and one line."""

from __future__ import annotations

from plait.checkpoint.checks import check_checkpoint
from plait.config.checks_layout import check_layout
from plait.config.schema import Config
from plait.data.checks import check_data
from plait.mesh import ParallelDims


def validate(cfg: Config, world_size: int) -> ParallelDims:
    """Check everything that can be checked before launch; return the resolved mesh degrees."""
    dims = check_layout(cfg, world_size)
    check_data(cfg.data, cfg.model.args())
    check_checkpoint(cfg)
    return dims
