"""Parallelisms: each transforms a plain single-device model in place.

`parallelize` applies them in one fixed order (DESIGN.md): pipeline split -> tensor (+sequence) ->
context -> expert -> activation checkpointing -> data (DDP or ZeRO). Implemented so far: tensor
(+ sequence) and data parallelism.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from plait.comm.allreduce import AllReduceAlgorithm
from plait.config import ParallelConfig
from plait.model.llama import Transformer
from plait.parallel.data_parallel import DataParallel, NaiveDataParallel
from plait.parallel.tensor_parallel import TensorParallelPlan, apply_tp, grad_norm_sq
from plait.parallel.vocab_parallel import vocab_parallel_cross_entropy


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens of (b, s, V) logits and (b, s) targets."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclass
class Parallelized:
    """A model with its parallelisms applied, and what the training step needs to go with them."""

    model: DataParallel  # outermost wrapper: forward, no_sync(), finish_gradients()
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> loss
    grad_norm_sq: Callable[[], torch.Tensor]  # squared norm of the whole model's gradient
    tp_plan: TensorParallelPlan


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: ParallelConfig) -> Parallelized:
    """Apply every configured parallelism to `model`, in place, in the documented order."""
    tp_group = mesh["tp"].get_group()
    plan = apply_tp(model, tp_group, cfg.sequence_parallel)
    loss_fn = cross_entropy
    if mesh["tp"].size() > 1:
        loss_fn = functools.partial(
            vocab_parallel_cross_entropy, group=tp_group, vocab_size=model.args.vocab_size
        )
    wrapped = DataParallel(
        model,
        mesh["dp"].get_group(),
        bucket_mb=cfg.bucket_mb,
        algorithm=AllReduceAlgorithm(cfg.allreduce),
    )
    return Parallelized(
        wrapped, loss_fn, functools.partial(grad_norm_sq, model, plan, tp_group), plan
    )


__all__ = ["DataParallel", "NaiveDataParallel", "Parallelized", "apply_tp", "parallelize"]
