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
from rich.console import Console
from rich.table import Table
from torch.distributed.elastic.multiprocessing.errors import record

from plait.bench.step import start_worker
from plait.bench.text import size_text
from plait.comm import LEDGER, Op
from plait.config.schema import Config, cp_variants, with_cp
from plait.launch import launch
from plait.predict.activations import activation_bytes
from plait.predict.cost import chunk_layouts
from plait.train.progress import each
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


def run_cp(cfg: Config, degrees: list[int], methods: list[str], steps: int,
           warmup: int) -> list[dict]:
    """One long sequence per step on one rank, then over C ranks by each method (`bench_cp`)."""

    # every variant was checked by the command before it imported this module (torch)
    variants = cp_variants(degrees, methods)
    configs = {v: with_cp(cfg, *v) for v in variants}
    rows = []
    for c, m in each(variants, "bench cp: cp, method"):
        rows.append({"cp": c, "method": m if c > 1 else "-",
                     **launch(c, bench_cp, configs[c, m], steps, warmup)[0]})
    args, one = cfg.model.args(), rows[0]
    table = Table(title=(
        f"plait bench cp: a sequence of {cfg.data.seq_len:,} tokens x {cfg.train.global_batch} "
        f"per step, model dim {args.dim} x {args.n_layers} layers ({args.n_heads} heads, "
        f"{args.n_kv_heads} kv); median of {steps} steps after {warmup}; no CPU peer (torch's "
        "context_parallel is CUDA-only)"))
    for col in ("cp", "method", "step (ms)", "vs cp 1", "cp comm wait (ms)", "cp bytes / step",
                "activations, rank 0", "formula", "activations vs cp 1"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["cp"]), r["method"], f"{r['step_s'] * 1e3:,.0f}",
                      f"{r['step_s'] / one['step_s']:.2f}", f"{r['cp_wait_s'] * 1e3:,.0f}",
                      size_text(r["cp_bytes"]) if r["cp_bytes"] else "-",
                      size_text(r["activation_bytes"]), size_text(r["activation_formula"]),
                      f"{r['activation_bytes'] / one['activation_bytes']:.2f}")
    Console(width=150).print(table)
    return rows
