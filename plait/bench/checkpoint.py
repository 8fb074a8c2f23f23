"""`plait bench checkpoint`: what a checkpoint costs each rank of a recipe, after one training step
(so that AdamW's state exists): bytes written, a synchronous save, an asynchronous one (the time
training is blocked, against the copy into memory alone, and until written), and a load. Medians
over the repeats; each rank's numbers are gathered, the slowest rank's reported (a save is done
when the last rank is).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from plait.bench.step import start_worker
from plait.checkpoint import step_path
from plait.checkpoint.rank_state import load, training_state
from plait.config.schema import Config
from plait.train.checkpointing import CopyStager
from plait.train.trainer import Trainer


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@record
def bench_checkpoint(cfg: Config, root: str, repeats: int) -> list[dict] | None:
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(
        cfg.checkpoint, dir=root, keep=1, resume="never"))
    dims, mesh = start_worker(cfg)
    trainer = Trainer(cfg, dims, mesh, torch.device("cpu"))
    trainer.train_step(0)
    saver, par, opt = trainer.checkpoints, trainer.parallelized, trainer.optimizer
    times: dict[str, list[float]] = {k: [] for k in ("sync", "blocked", "copy", "async", "load")}
    for i in range(repeats):
        saver.ck = dataclasses.replace(saver.ck, async_=False)
        times["sync"].append(_timed(lambda i=i: saver.save(2 * i + 1, par, opt)))
        saver.ck = dataclasses.replace(saver.ck, async_=True)
        start = time.perf_counter()
        times["blocked"].append(_timed(lambda i=i: saver.save(2 * i + 2, par, opt)))
        saver.wait()
        times["async"].append(time.perf_counter() - start)
        times["copy"].append(_timed(lambda: CopyStager().stage(training_state(par, opt))))
        path = step_path(root, 2 * i + 2)
        times["load"].append(_timed(lambda path=path: load(path, par, opt, saver.group)))
    mine = Path(path) / f"__{dist.get_rank()}_0.distcp"
    row = {k: statistics.median(v) for k, v in times.items()}
    row["bytes"] = mine.stat().st_size if mine.exists() else 0  # deduplicated replicas: none
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rows if rank == 0 else None
