"""`plait bench cp`: one long sequence per step, trained on one rank (cp = 1) and split over C ranks
by ring attention and by Ulysses. Per variant: the median step time after warm-up, the time
blocked in the cp collectives (shifts of key/value blocks, or all-to-alls) and their bytes, and
the activation bytes kept for backward on rank 0, measured and from the formula
(`plait.predict.activations`), which falls as 1/C for the sequence-sharded work.

PyTorch's own context parallelism (`torch.distributed.tensor.experimental.context_parallel`) runs
on CUDA only: on a CPU there is no peer to run against, so the reference is the single rank.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from plait.bench.step import start_worker
from plait.comm import LEDGER, Op
from plait.config.schema import Config
from plait.predict.activations import activation_bytes
from plait.predict.cost import chunk_layouts
from plait.train.trainer import Trainer


@record
def bench_cp(cfg: Config, steps: int, warmup: int) -> dict | None:
    dims, mesh = start_worker(cfg)
    trainer = Trainer(cfg, dims, mesh, torch.device("cpu"))
    ops = (Op.SEND, Op.ALL_TO_ALL)  # the cp collectives (nothing else sends or all-to-alls here)
    times, waits, moved, kept = [], [], [], []
    for step in range(warmup + steps):
        LEDGER.reset()
        start = time.perf_counter()
        result = trainer.train_step(step)
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)
            waits.append(sum(LEDGER.wait_by_op[op] for op in ops))
            moved.append(float(sum(LEDGER.bytes_by_op[op] for op in ops)))
            kept.append(result["activation_bytes"])
    row = {"step_s": statistics.median(times), "cp_wait_s": statistics.median(waits),
           "cp_bytes": statistics.median(moved), "activation_bytes": max(kept),
           "activation_formula": activation_bytes(cfg, dims, chunk_layouts(trainer.model))}
    rank = dist.get_rank()
    dist.destroy_process_group()
    return row if rank == 0 else None
