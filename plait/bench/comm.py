"""`plait bench comm --nproc N`: bandwidth of every collective and of the three all-reduce
algorithms, at several sizes.

Definitions are nccl-tests' (PERFORMANCE.md there): for a message of S bytes taking t seconds,
algorithm bandwidth algbw = S / t, and bus bandwidth busbw = algbw * factor, the factor turning
it into what each link carried so that all collectives compare with the hardware's peak:
all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all (n-1)/n, broadcast and send 1.
S is the full tensor (all-gather's output, reduce-scatter's input).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.elastic.multiprocessing.errors import record

from plait import comm
from plait.bench.text import size_text
from plait.comm.allreduce import AllReduceAlgorithm, all_reduce_by
from plait.comm.collectives import Op, bus_bytes
from plait.launch import launch
from plait.train.progress import each

SIZES = [2**10, 2**14, 2**18, 2**20, 2**22, 2**24]  # bytes: 1 KiB to 16 MiB


def _cases(n: int, rank: int, group):
    """(name, op for the bus factor, callable for a message of `size` bytes), each run by all."""

    def allreduce_with(algorithm):
        def make(size):
            t = torch.zeros(size // 4)  # zeros stay zeros however often they are summed
            return lambda: all_reduce_by(algorithm, t, group).wait()

        return make

    def gather(size):
        out, shard = torch.empty(size // 4), torch.zeros(size // 4 // n)
        return lambda: comm.all_gather(out, shard, group)

    def scatter(size):
        full, out = torch.zeros(size // 4), torch.empty(size // 4 // n)
        return lambda: comm.reduce_scatter(out, full, group)

    def alltoall(size):
        a, b = torch.zeros(size // 4), torch.empty(size // 4)
        return lambda: comm.all_to_all(b, a, group)

    def bcast(size):
        t = torch.zeros(size // 4)
        return lambda: comm.broadcast(t, 0, group)

    return [
        ("all_reduce (backend)", Op.ALL_REDUCE, allreduce_with(AllReduceAlgorithm.BACKEND)),
        ("all_reduce (ring)", Op.ALL_REDUCE, allreduce_with(AllReduceAlgorithm.RING)),
        ("all_reduce (naive)", Op.ALL_REDUCE, allreduce_with(AllReduceAlgorithm.NAIVE)),
        ("all_gather", Op.ALL_GATHER, gather),
        ("reduce_scatter", Op.REDUCE_SCATTER, scatter),
        ("all_to_all", Op.ALL_TO_ALL, alltoall),
        ("broadcast", Op.BROADCAST, bcast),
    ]


def time_call(fn, group, min_seconds: float) -> float:
    """Seconds per call, the slowest rank's. Ranks agree up front on how many calls fill about
    `min_seconds` (from one timed call after the warm-up), then run them back to back."""
    fn()  # warm up (connections, allocations)
    start = time.perf_counter()
    fn()
    once = torch.tensor([time.perf_counter() - start])
    comm.all_reduce(once, group, op=dist.ReduceOp.MAX)
    iters = max(3, min(1000, int(min_seconds / max(once.item(), 1e-6))))
    comm.all_reduce(torch.zeros(1), group)  # start together
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    per_call = torch.tensor([(time.perf_counter() - start) / iters])
    comm.all_reduce(per_call, group, op=dist.ReduceOp.MAX)
    return per_call.item()


@record
def bench_comm(sizes: list[int], min_seconds: float) -> list[dict] | None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group, n, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    rows, cases = [], {name: (op, make) for name, op, make in _cases(n, rank, group)}
    for name in each(list(cases), "bench comm", enabled=rank == 0):
        op, make = cases[name]
        for size in sizes:
            size -= size % (4 * n)  # whole fp32 shards for every rank
            t = time_call(make(size), group, min_seconds)
            algbw = size / t
            rows.append({
                "collective": name, "bytes": size, "time_us": t * 1e6,
                "algbw_GBps": algbw / 1e9,
                "busbw_GBps": algbw * float(bus_bytes(op, n, size) / size) / 1e9,
            })
    dist.destroy_process_group()
    return rows if rank == 0 else None


def run_comm(nproc: int, min_seconds: float = 0.2) -> list[dict]:
    rows = launch(nproc, bench_comm, SIZES, min_seconds)[0]
    table = Table(title=f"plait bench comm: {nproc} ranks, gloo on loopback "
                        "(nccl-tests definitions: algbw = S/t, busbw = algbw x bus factor)")
    for col in ("collective", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
        table.add_column(col, justify="left" if col == "collective" else "right")
    for r in rows:
        table.add_row(r["collective"], size_text(r["bytes"]), f"{r['time_us']:,.0f}",
                      f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}")
    Console(width=120).print(table)
    return rows
