"""plait: a distributed training engine for PyTorch.

The Python API (`plait/api.py`; docs/python.md): `init`, `prepare`, `print0`,
`finish`, `estimate` (a layout's bytes, FLOPs and collectives per rank before launch) and
`plan` (every data-parallel layout of a module, priced: `plait/api_estimate.py`; the planner
itself is `plait.planner`), with `ParallelConfig`, `WrapPolicy`, `ModelPlan`,
`LossScaler` (fp16) and `load_hf` (a Hugging Face folder).
They are imported when first used, so that `import plait.cli` stays light.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "init": "plait.api",
    "prepare": "plait.api",
    "finish": "plait.api",
    "print0": "plait.api",
    "Prepared": "plait.api",
    "ParallelConfig": "plait.config.schema",
    "WrapPolicy": "plait.parallel.wrap",
    "LossScaler": "plait.optim.loss_scaling",
    "ModelPlan": "plait.model.plan",
    "load_hf": "plait.model.hf",
    "estimate": "plait.api_estimate",
    "plan": "plait.api_estimate",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'plait' has no attribute {name!r}")
