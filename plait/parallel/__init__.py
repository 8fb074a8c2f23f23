"""Parallelisms: each transforms a plain single-device model in place.

`parallelize` applies them in one fixed order (DESIGN.md): pipeline split -> tensor (+sequence) ->
context -> expert -> activation checkpointing -> data (DDP or ZeRO). Only data parallelism exists
so far.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.parallel.data_parallel import NaiveDataParallel


def parallelize(model: nn.Module, mesh: DeviceMesh) -> NaiveDataParallel:
    """Apply every configured parallelism to `model`; returns the outermost wrapper, whose
    `finish_gradients()` the trainer calls after the step's last backward."""
    return NaiveDataParallel(model, mesh["dp"].get_group())


__all__ = ["NaiveDataParallel", "parallelize"]
