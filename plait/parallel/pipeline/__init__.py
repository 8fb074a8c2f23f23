"""Pipeline parallelism over the `pp` axis: schedules as data (`schedules`), their checker and
ideal-clock simulator (`simulator`), the model cut into chunks (`stage`), one executor for all
schedules (`executor`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.comm import all_reduced
from plait.config import ParallelConfig
from plait.model.llama import Transformer
from plait.parallel.pipeline.executor import PipelineExecutor
from plait.parallel.pipeline.schedules import build_schedule, forward_only
from plait.parallel.pipeline.simulator import check
from plait.parallel.pipeline.stage import split_model


def apply_pp(model: Transformer, mesh: DeviceMesh, cfg: ParallelConfig, microbatches: int):
    """Keep only this stage's chunks of `model` (in place); returns (chunks container, schedule).

    The container is an `nn.ModuleDict` keyed by global chunk index."""
    P, stage = mesh["pp"].size(), mesh["pp"].get_local_rank()
    V = cfg.pp_virtual if cfg.pp_schedule == "interleaved" else 1
    schedule = build_schedule(cfg.pp_schedule, P, microbatches, V)
    check(schedule)
    chunks = split_model(model, P * V, list(cfg.pp_split) or None)
    mine = nn.ModuleDict({str(c): chunks[c] for c in range(P * V) if c % P == stage})
    kept = {id(p) for p in mine.parameters()}
    for i in [i for i, block in model.layers.items()
              if not any(id(p) in kept for p in block.parameters())]:
        del model.layers[i]  # other stages' layers: not held here
    for name in ("tok_embeddings", "norm", "output"):
        if not any(id(p) in kept for p in getattr(model, name).parameters()):
            setattr(model, name, nn.Identity())
    return mine, schedule


def executors(wrapped, mine: nn.ModuleDict, schedule, mesh: DeviceMesh, loss_fn, dim, device):
    """(training executor, evaluation executor) for this stage."""
    chunks = {int(c): m for c, m in mine.items()}
    group = mesh["pp"].get_group()
    train = PipelineExecutor(schedule, chunks, group, loss_fn, dim, device, wrapped.no_sync)
    evaluate = PipelineExecutor(
        forward_only(schedule.stages, schedule.microbatches, schedule.chunks_per_stage),
        chunks, group, loss_fn, dim, device,
    )
    return train, evaluate


def pp_grad_norm_sq(module: nn.Module, group) -> torch.Tensor:
    """Squared gradient norm of the whole model: each stage's own parameters, summed over pp."""
    local = sum(p.grad.double().pow(2).sum() for p in module.parameters() if p.grad is not None)
    return all_reduced(torch.as_tensor(local, dtype=torch.float64).reshape(1), group)[0]
