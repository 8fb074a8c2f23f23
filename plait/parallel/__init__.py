"""Parallelisms: each transforms a plain single-device model in place.

`parallelize` applies them in one fixed order (DESIGN.md): pipeline split -> tensor (+sequence) ->
context -> expert -> activation checkpointing -> data (DDP or ZeRO). Only data parallelism exists
so far.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.comm.allreduce import AllReduceAlgorithm
from plait.config import ParallelConfig
from plait.parallel.data_parallel import DataParallel, NaiveDataParallel


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig) -> DataParallel:
    """Apply every configured parallelism to `model`; returns the outermost wrapper, whose
    `no_sync()` and `finish_gradients()` the trainer uses around backward."""
    return DataParallel(
        model,
        mesh["dp"].get_group(),
        bucket_mb=cfg.bucket_mb,
        algorithm=AllReduceAlgorithm(cfg.allreduce),
    )


__all__ = ["DataParallel", "NaiveDataParallel", "parallelize"]
