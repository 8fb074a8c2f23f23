"""This machine as `plait plan --calibrate` measured it (`plait/bench/calibrate.py` runs the
measurements; the planner reads what was stored, or measures the matmul rate alone when nothing
was), so that `--gpu cpu` plans are in its seconds.

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

import json
import os
import time
from pathlib import Path

import torch

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


def measure_cpu_flops(size: int = 512, seconds: float = 0.3) -> float:
    """FLOP/s of one thread on fp32 matmuls: the ceiling a CPU rank can reach, since CPUs publish
    no single peak."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm up
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    return 2 * size**3 * n / (time.perf_counter() - start)
