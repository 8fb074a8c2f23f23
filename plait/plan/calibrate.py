"""`plait plan --calibrate`: this machine measured, so that `--gpu cpu` plans are in its seconds.

    matmul rate    one thread's fp32 FLOP/s on 512 x 512 matmuls (`measure_cpu_flops`)
    efficiency     the share of that rate a training step's matmuls reach, and the overheads
                   beside them: one-rank steps of a small model (median of several, after
                   warm-up) at 8 and 2 sequences and at 4 micro-batches, fitted to
                   t = per step + per micro-batch x M + per sequence x B; the FLOPs of a
                   sequence (as the planner counts them) over its time give the efficiency
    links          per world size n in 2, 4, 8: all-reduces of 4 KiB to 4 MiB by gloo on
                   loopback, timed as `bench comm` times them, fitted by least squares to the
                   planner's alpha-beta model t = 2(n-1) alpha + bus bytes / beta
    cores          ranks beyond the cores share them: compute slows by ranks / cores, and
                   collectives hide behind compute only while a core is left for them

The result is JSON in $XDG_CACHE_HOME/plait/calibration.json (~/.cache by default).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from plait import comm
from plait.comm.collectives import Op, bus_bytes

LINK_SIZES = [2**12, 2**14, 2**16, 2**18, 2**20, 2**22]  # bytes
LINK_RANKS = (2, 4, 8)
# The one-rank step whose time sets the efficiency: the 'small' preset at 8 x 128 tokens.
STEP_OVERRIDES = ["model.preset='small'", "train.global_batch=8", "data.seq_len=128"]


def path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "plait" / "calibration.json"


KEYS = {"matmul_flops", "efficiency", "step_overhead_s", "microbatch_overhead_s", "cores", "links",
        "measured_at"}


def load() -> dict | None:
    """The stored calibration, or None when this machine has none (or an unreadable one, or
    one an older plait wrote)."""
    try:
        found = json.loads(path().read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and KEYS <= found.keys() else None


def fit_alpha_beta(n: int, samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(alpha seconds per message step, beta bytes/s) of all-reduces of (bytes, seconds) on n
    ranks, by least squares on t = 2(n-1) alpha + bus bytes / beta (alpha >= 0)."""
    steps = 2 * (n - 1)
    x = torch.tensor([[steps, float(bus_bytes(Op.ALL_REDUCE, n, s))] for s, _ in samples],
                     dtype=torch.float64)
    t = torch.tensor([[sec] for _, sec in samples], dtype=torch.float64)
    alpha, inverse_beta = torch.linalg.lstsq(x, t).solution.flatten().tolist()
    if alpha < 0:  # latency below resolution: bandwidth alone
        alpha, inverse_beta = 0.0, float((x[:, 1:] * t).sum() / (x[:, 1:] ** 2).sum())
    return alpha, 1.0 / max(inverse_beta, 1e-15)


@record
def time_all_reduces(sizes: list[int], min_seconds: float) -> list[tuple[int, float]] | None:
    """On every rank: seconds per all-reduce of each size (the slowest rank's)."""
    from plait.bench.comm import time_call

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
    from plait.bench.plan import measure_run
    from plait.checks import validate
    from plait.config import load_config
    from plait.launch import launch
    from plait.plan import estimate
    from plait.plan.hardware import Cluster, Device
    from plait.train.metrics import measure_cpu_flops

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
    ideal = Device("ideal", rate, 1e12, 1.0, 1.0, efficiency=1.0)
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


def calibrated_device(found: dict, ranks: int):
    """The `cpu` device for a job of `ranks` ranks on the measured machine: the links measured
    at the nearest world size at or below it, compute shared when ranks exceed the cores."""
    from plait.plan.hardware import Device, host_memory_per_rank

    measured = sorted(int(n) for n in found["links"])
    n = max([m for m in measured if m <= ranks] or measured[:1])
    link = found["links"][str(n)]
    share = min(1.0, found["cores"] / ranks)
    return dataclasses.replace(
        Device(f"cpu (calibrated {found['measured_at']})", found["matmul_flops"],
               host_memory_per_rank(ranks),
               link["beta_Bps"] / 1e9, link["beta_Bps"] / 1e9),
        intra_alpha_s=link["alpha_s"], inter_alpha_s=link["alpha_s"],
        efficiency=found["efficiency"] * share, step_overhead_s=found["step_overhead_s"] / share,
        microbatch_overhead_s=found["microbatch_overhead_s"] / share,
        overlap=ranks < found["cores"])
