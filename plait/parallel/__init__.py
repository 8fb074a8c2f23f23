"""Parallelisms: each transforms a plain single-device model in place.

`parallelize` applies them in one fixed order (DESIGN.md): pipeline split -> tensor (+sequence) ->
context -> expert -> activation checkpointing -> data (DDP or ZeRO). Implemented so far: pipeline
(with data), tensor + sequence (with data), data as DDP or ZeRO-1/2/3. Context and expert
parallelism, activation checkpointing, and the compositions pp x tp, ZeRO x tp, ZeRO x pp are
refused by the configuration until they exist.
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
from plait.parallel.fsdp import FullyShardedDataParallel
from plait.parallel.pipeline import PipelineExecutor, apply_pp, executors, pp_grad_norm_sq
from plait.parallel.state import model_state_bytes
from plait.parallel.tensor_parallel import TensorParallelPlan, apply_tp, grad_norm_sq
from plait.parallel.vocab_parallel import vocab_parallel_cross_entropy
from plait.parallel.zero import ZeroDataParallel

# Data parallelism that shards model state over dp: the optimizer owns slices, not parameters.
SHARDED = (ZeroDataParallel, FullyShardedDataParallel)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens of (b, s, V) logits and (b, s) targets."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclass
class Parallelized:
    """A model with its parallelisms applied, and what the training step needs to go with them."""

    model: DataParallel | ZeroDataParallel | FullyShardedDataParallel  # the outermost wrapper
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> loss
    grad_norm_sq: Callable[[], torch.Tensor]  # squared norm of the whole model's gradient
    tp_plan: TensorParallelPlan
    pipeline: PipelineExecutor | None = None  # with pp > 1: runs a training step's schedule
    pipeline_eval: PipelineExecutor | None = None  # and a forward-only pass

    def optimizer_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(decay, no_decay): the tensors the optimizer owns. Matrices and embeddings decay; norm
        gains do not. Under ZeRO these are this rank's slices of the flat parameters."""
        if isinstance(self.model, SHARDED):
            return self.model.optimizer_groups()
        params = [p for p in self.model.module.parameters() if p.requires_grad]
        return [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]

    def finish_step(self) -> None:
        """After the optimizer step: ZeRO gathers the updated slices back into every replica."""
        if isinstance(self.model, SHARDED):
            self.model.finish_step()

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        if isinstance(self.model, SHARDED):
            return self.model.state_bytes(optimizer)
        return model_state_bytes(self.model.module, optimizer)


def parallelize(
    model: Transformer,
    mesh: DeviceMesh,
    cfg: ParallelConfig,
    bf16: bool = False,
    microbatches: int = 1,
) -> Parallelized:
    """Apply every configured parallelism to `model`, in place, in the documented order. With
    `bf16` and ZeRO, parameters are held in bf16 with fp32 masters of each rank's slices (without
    ZeRO, bf16 is the trainer's autocast over fp32 parameters)."""
    if mesh["pp"].size() > 1:
        return _parallelize_pipeline(model, mesh, cfg, microbatches)
    tp_group = mesh["tp"].get_group()
    plan = apply_tp(model, tp_group, cfg.sequence_parallel)
    loss_fn = cross_entropy
    if mesh["tp"].size() > 1:
        loss_fn = functools.partial(
            vocab_parallel_cross_entropy, group=tp_group, vocab_size=model.args.vocab_size
        )
    dp_group = mesh["dp"].get_group()
    precision = {
        "param_dtype": torch.bfloat16 if bf16 else None,
        "reduce_dtype": torch.bfloat16 if bf16 and cfg.reduce_dtype == "bf16" else torch.float32,
    }
    if cfg.zero == 3:
        wrapped = FullyShardedDataParallel(model, dp_group, **precision, offload=cfg.offload)
        norm_sq = wrapped.grad_norm_sq
    elif cfg.zero:
        wrapped = ZeroDataParallel(model, dp_group, cfg.zero, cfg.bucket_mb, **precision,
                                   offload_optimizer=cfg.offload == "optimizer")
        norm_sq = wrapped.grad_norm_sq
    else:
        wrapped = DataParallel(
            model, dp_group, bucket_mb=cfg.bucket_mb, algorithm=AllReduceAlgorithm(cfg.allreduce)
        )
        norm_sq = functools.partial(grad_norm_sq, model, plan, tp_group)
    return Parallelized(wrapped, loss_fn, norm_sq, plan)


def _parallelize_pipeline(model: Transformer, mesh: DeviceMesh, cfg: ParallelConfig,
                          microbatches: int) -> Parallelized:
    """pp (x dp): this stage's chunks, replicated over dp, run by the schedule's executor."""
    dim, device = model.args.dim, next(model.parameters()).device
    mine, schedule = apply_pp(model, mesh, cfg, microbatches)
    wrapped = DataParallel(mine, mesh["dp"].get_group(), bucket_mb=cfg.bucket_mb,
                           algorithm=AllReduceAlgorithm(cfg.allreduce))
    train, evaluate = executors(wrapped, mine, schedule, mesh, cross_entropy, dim, device)
    norm_sq = functools.partial(pp_grad_norm_sq, mine, mesh["pp"].get_group())
    plan = TensorParallelPlan(replicated={n for n, _ in mine.named_parameters()})
    return Parallelized(wrapped, cross_entropy, norm_sq, plan, train, evaluate)


__all__ = [
    "DataParallel",
    "FullyShardedDataParallel",
    "NaiveDataParallel",
    "Parallelized",
    "ZeroDataParallel",
    "apply_tp",
    "parallelize",
]
