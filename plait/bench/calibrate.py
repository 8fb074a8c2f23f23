"""`plait plan --calibrate`: measure this machine and store it (`plait/planner/calibrate.py` holds
what is measured and how the planner reads it; measuring runs processes, so it lives with the
benches and the planner stays free of them)."""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.elastic.multiprocessing.errors import record

from plait import comm
from plait.bench.comm import time_call
from plait.bench.planner import measure_run
from plait.config.schema import load_config
from plait.launch import launch
from plait.planner.calibrate import (
    LINK_RANKS,
    LINK_SIZES,
    STEP_OVERRIDES,
    fit_alpha_beta,
    measure_cpu_flops,
    path,
)
from plait.planner.hardware import Cluster, Device
from plait.planner.price import estimate
from plait.train.checks import validate


@record
def time_all_reduces(sizes: list[int], min_seconds: float) -> list[tuple[int, float]] | None:
    """On every rank: seconds per all-reduce of each size (the slowest rank's)."""

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    out = []
    for size in sizes:
        t = torch.zeros(size // 4)  # zeros stay zeros however often they are summed
        out.append((size, time_call(lambda t=t: comm.all_reduce(t, group), group, min_seconds)))
    rank = dist.get_rank()
    dist.destroy_process_group()
    return out if rank == 0 else None


def calibrate(min_seconds: float = 0.2, steps: int = 5) -> dict:
    """Measure this machine and store the result; returns it."""

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a rank's share: workers run one thread each
    rate = statistics.median(measure_cpu_flops() for _ in range(3))
    torch.set_num_threads(threads)
    # Three one-rank steps: t = c0 + c1 M + k B (B sequences in M micro-batches) separates the
    # per-step and per-micro-batch overheads from the time per sequence, whose FLOPs set the
    # efficiency.
    times = {}
    for batch, m in ((8, 1), (2, 1), (8, 4)):
        cfg = load_config(None, [*STEP_OVERRIDES, f"train.global_batch={batch}",
                                 f"parallel.microbatches={m}"])
        times[batch, m] = launch(1, measure_run, cfg, steps)[0]["step_s"]
    per_microbatch = max(0.0, (times[8, 4] - times[8, 1]) / 3)
    per_sequence = (times[8, 1] - times[2, 1]) / 6
    if per_sequence <= 0:
        raise RuntimeError(f"calibration: 8 sequences took no longer than 2 ({times}); the "
                           "machine is too busy to measure, run it again when it is idle")
    per_step = max(0.0, times[8, 1] - 8 * per_sequence - per_microbatch)
    ideal = Device("ideal", rate, 1e12, 1.0, 1.0, efficiency=1.0, gloo=True)  # this CPU
    cfg = load_config(None, [*STEP_OVERRIDES, "train.global_batch=1"])
    flops_time = estimate(cfg, validate(cfg, 1), Cluster(1, 1, ideal)).step_time_s
    links = {}
    for n in LINK_RANKS:
        samples = launch(n, time_all_reduces, LINK_SIZES, min_seconds)[0]
        alpha, beta = fit_alpha_beta(n, samples)
        links[str(n)] = {"alpha_s": alpha, "beta_Bps": beta, "samples": samples}
    result = {"matmul_flops": rate, "efficiency": flops_time / per_sequence,
              "step_overhead_s": per_step, "microbatch_overhead_s": per_microbatch,
              "step_s": times[8, 1],
              "cores": os.cpu_count() or 1, "links": links,
              "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    path().parent.mkdir(parents=True, exist_ok=True)
    path().write_text(json.dumps(result, indent=1) + "\n")
    return result


def calibrate_and_print() -> dict:
    """`plait plan --calibrate`: measure, store, and show what was measured."""
    found = calibrate()
    console = Console(width=120)
    table = Table(title=f"plait plan --calibrate: this machine ({found['cores']} cores), stored "
                        f"in {path()}")
    for col in ("measure", "value"):
        table.add_column(col, justify="left" if col == "measure" else "right")
    table.add_row("fp32 matmul, one thread", f"{found['matmul_flops'] / 1e9:.1f} GFLOP/s")
    table.add_row("matmul efficiency in a step (1 rank, 'small' preset)",
                  f"{found['efficiency']:.1%} of it ({found['step_s'] * 1e3:.0f} ms a step)")
    table.add_row("overheads beside the matmuls", f"{found['step_overhead_s'] * 1e3:.1f} ms a "
                  f"step, {found['microbatch_overhead_s'] * 1e3:.1f} ms a micro-batch")
    for n, link in found["links"].items():
        table.add_row(f"gloo all-reduce, {n} ranks",
                      f"alpha {link['alpha_s'] * 1e6:,.0f} us/step, "
                      f"beta {link['beta_Bps'] / 1e9:.2f} GB/s")
    console.print(table)
    return found
