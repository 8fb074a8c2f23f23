"""`plait bench checkpoint`: what a checkpoint costs each rank of a recipe, after one training step
(so that AdamW's state exists): bytes written, a synchronous save, an asynchronous one (the time
training is blocked, against the copy into memory alone, and until written), and a load. Medians
over the repeats; each rank's numbers are gathered, the slowest rank's reported (a save is done
when the last rank is).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.elastic.multiprocessing.errors import record

from plait.bench.step import start_worker, with_free_dp
from plait.bench.text import size_text
from plait.checkpoint import step_path
from plait.checkpoint.rank_state import load, training_state
from plait.config.schema import Config
from plait.launch import launch
from plait.train.checkpointing import CopyStager
from plait.train.checks import validate
from plait.train.progress import each
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


def run_checkpoint(recipes: list[tuple[str, Config, int]], repeats: int) -> list[dict]:
    """Save and load costs per rank of each (name, config, world size): `bench_checkpoint` above."""

    table = Table(title=f"plait bench checkpoint: torch.distributed.checkpoint, every rank "
                        f"writing what it holds; slowest rank, median of {repeats}")
    for col in ("recipe", "ranks", "bytes/rank", "sync save (ms)", "async: blocked (ms)",
                "copy alone (ms)", "async: written (ms)", "load (ms)"):
        table.add_column(col, justify="left" if col == "recipe" else "right")
    out = []
    configs = {name: (cfg, nproc) for name, cfg, nproc in recipes}
    for name in each(list(configs), "checkpoint"):
        cfg, nproc = configs[name]
        validate(with_free_dp(cfg), nproc)
        with tempfile.TemporaryDirectory(prefix="plait-bench-ck-") as root:
            rows = launch(nproc, bench_checkpoint, with_free_dp(cfg), root, repeats)[0]
        worst = {k: max(r[k] for r in rows) for k in rows[0]}
        sizes = sorted(r["bytes"] for r in rows)
        table.add_row(name, str(nproc), f"{size_text(sizes[0])} - {size_text(sizes[-1])}",
                      *(f"{worst[k] * 1e3:,.1f}" for k in ("sync", "blocked", "copy", "async",
                                                            "load")))
        out.append({"recipe": name, "ranks": nproc, **worst, "bytes": sizes})
    Console(width=140).print(table)
    return out
