"""`plait bench step --nproc N` with pp > 1 (and any tp, zero): plait's composition against
PyTorch's own, on the same model chunks, global batch and seed:

    torch: torch.distributed.pipelining (PipelineStage + the schedule's class) over the pp axis,
           DTensor `parallelize_module` (the Megatron colwise / rowwise plan) over tp, and
           `fully_shard` (FSDP2) over dp, per block and per chunk.

FSDP2 is fully sharded (ZeRO-3) whatever plait's stage; it is run with reshard_after_forward
False for plait's ZeRO-1/2 (parameters kept whole through the step) and True for ZeRO-3. The
torch head gathers the logits (output_layouts=Replicate) for a plain cross-entropy; plait's stays
vocabulary-parallel. Sequence parallelism is plait's only. Each side runs in processes of its
own, the sides launched by turns (`bench step`'s isolation: torch's processes never carry the
allocator setting plait's ZeRO-3 makes); plait's variants take turns within theirs.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from plait.bench.step import plait_step, start_worker, step_times
from plait.config.schema import Config, microbatches
from plait.data.batches import TokenData
from plait.host_memory import malloc_threshold
from plait.model import build_model
from plait.parallel.pipeline.stage import split_model
from plait.parallel.tensor_parallel import block_splits

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                   "interleaved": ScheduleInterleaved1F1B}


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _chunk_tp_plan(chunk) -> dict:
    plan = {f"layers.{i}.{path}": ColwiseParallel() if dim == 0 else RowwiseParallel()
            for i, block in chunk.layers.items()
            for path, dim in block_splits(chunk.plan, block).items()}
    if chunk.first:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if chunk.last:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def torch_3d_step(cfg: Config, dims, mesh, x, y):
    # FSDP2 warns that a chunk returns a view (in-place ops on it would skip its hooks); none
    # follows here.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    par = cfg.parallel
    P = dims.pp
    V = par.pp_virtual if par.pp_schedule == "interleaved" else 1
    chunks = split_model(build_model(cfg.model.args(), cfg.train.seed), P * V,
                         list(par.pp_split) or None)
    stage = mesh["pp"].get_local_rank()
    mine = [(c, chunks[c]) for c in range(P * V) if c % P == stage]
    device = torch.device("cpu")
    for _, chunk in mine:
        if dims.tp > 1:
            parallelize_module(chunk, mesh["tp"], _chunk_tp_plan(chunk))
        for block in chunk.layers.values():
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=par.zero == 3)
        fully_shard(chunk, mesh=mesh["dp"], reshard_after_forward=par.zero == 3)
    stages = [PipelineStage(chunk, c, P * V, device, group=mesh["pp"].get_group())
              for c, chunk in mine]
    schedule = TORCH_SCHEDULES[par.pp_schedule](stages if V > 1 else stages[0],
                                                n_microbatches=microbatches(par, dims),
                                                loss_fn=_cross_entropy)
    opt = torch.optim.AdamW([p for _, c in mine for p in c.parameters()], lr=1e-4)
    has_last = any(c.last for _, c in mine)

    def step():
        opt.zero_grad(set_to_none=True)
        if stage == 0:
            schedule.step(x)
        elif has_last:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()

    return step


@record
def bench_3d(cfg: Config, steps: int, side: str) -> dict | None:
    """One side's step times on this world (each side in processes of its own): plait's layout
    and its ZeRO-3 ("plait"), or torch's composition ("torch"); and the glibc threshold this
    process set."""
    dims, mesh = start_worker(cfg)
    dp_rank = mesh["dp"].get_local_rank()
    x, y = TokenData(cfg.data, cfg.train.seed).batch(0, cfg.train.global_batch, dp_rank, dims.dp)
    if side == "plait":
        runners = {"plait": plait_step(cfg, dims, mesh)}
        if cfg.parallel.zero != 3:  # the algorithm fully_shard implements: a like-for-like row
            zero3 = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=3))
            runners["plait_zero3"] = plait_step(zero3, dims, mesh)
    else:
        runners = {"torch": torch_3d_step(cfg, dims, mesh, x, y)}
    times = step_times(runners, dist.group.WORLD, steps)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {**times, "malloc_threshold": malloc_threshold()} if rank == 0 else None
