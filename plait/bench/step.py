"""`plait bench step --nproc N [overrides]`: a training step under plait's DDP against the same
step under `torch.nn.parallel.DistributedDataParallel`, in one run.

Per world size (1, 2, 4, ... up to N; the same global batch each time, i.e. strong scaling) three
steps take turns, in rotating order so that none always runs first: plait, torch, and plait with
communication skipped (every micro-batch under `no_sync`, no all-reduce). Reported, from the
medians:

- ratio plait / torch (below 1: plait is faster);
- exposed communication: (plait step - step without communication) / plait step, the part of the
  all-reduce that backward did not hide;
- scaling efficiency T1 / (N * TN).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from plait import comm
from plait.comm.allreduce import AllReduceAlgorithm
from plait.config import Config, validate
from plait.mesh import build_mesh
from plait.model import build_model
from plait.parallel import DataParallel
from plait.train.data import TokenData


def world_sizes(nproc: int) -> list[int]:
    sizes = [1]
    while sizes[-1] * 2 <= nproc:
        sizes.append(sizes[-1] * 2)
    return sizes if sizes[-1] == nproc else [*sizes, nproc]


def with_free_dp(cfg: Config) -> Config:
    """The benchmark sets the world size; dp takes it whole."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=0))


class _Runner:
    """One wrapped model, its optimizer, and the step over this rank's rows in micro-batches."""

    def __init__(self, wrapped, model, micro_batches, communicate: bool):
        self.wrapped, self.model, self.micro_batches = wrapped, model, micro_batches
        self.communicate = communicate
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        last = len(self.micro_batches) - 1
        for i, (x, y) in enumerate(self.micro_batches):
            sync = self.communicate and i == last
            with contextlib.nullcontext() if sync else self.wrapped.no_sync():
                logits = self.wrapped(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / len(self.micro_batches)
                loss.backward()
        if self.communicate and hasattr(self.wrapped, "finish_gradients"):
            self.wrapped.finish_gradients()
        self.opt.step()


@record
def bench_step(cfg: Config, steps: int) -> dict | None:
    torch.set_num_threads(cfg.train.threads)
    dist.init_process_group("gloo")
    dims = validate(cfg, dist.get_world_size())
    group = build_mesh(dims)["dp"].get_group()
    rank, n, args = dist.get_rank(), dims.dp, cfg.model.args()
    x, y = TokenData(cfg.data, cfg.train.seed).batch(0, cfg.train.global_batch, rank, n)
    micro = cfg.train.micro_batch or len(x)
    batches = list(zip(x.split(micro), y.split(micro), strict=True))

    def model():
        return build_model(args, cfg.train.seed)

    par = cfg.parallel
    ours, theirs, local = model(), model(), model()
    algorithm = AllReduceAlgorithm(par.allreduce)
    plait_ddp = DataParallel(ours, group, bucket_mb=par.bucket_mb, algorithm=algorithm)
    torch_ddp = DistributedDataParallel(theirs, process_group=group, bucket_cap_mb=par.bucket_mb)
    runners = {
        "plait": _Runner(plait_ddp, ours, batches, communicate=True),
        "torch": _Runner(torch_ddp, theirs, batches, communicate=True),
        "no_comm": _Runner(DataParallel(local, group), local, batches, communicate=False),
    }
    times = {name: [] for name in runners}
    order = list(runners)
    for i in range(steps + 2):  # two warm-up rounds
        for name in order[i % 3 :] + order[: i % 3]:
            comm.all_reduce(torch.zeros(1), group)  # start together
            start = time.perf_counter()
            runners[name].step()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    medians = {}
    for name, ts in times.items():
        t = torch.tensor([statistics.median(ts)])
        comm.all_reduce(t, group, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        medians[name] = t.item()
    dist.destroy_process_group()
    return medians if rank == 0 else None
