"""`plait bench moe`: a mixture-of-experts recipe's training step at several expert-parallel
degrees on the same ranks (dp = ranks / ep), against ep = 1, where every rank holds every expert
and loops over them (no all-to-all: the reference). Per degree: the median step time after
warm-up, the time blocked in all-to-alls and its share of the step, their bytes, and the routing
(the same at every degree: routing does not depend on the layout). The expert load, assignments
kept per expert and step in each MoE layer, is drawn as a histogram.
"""

from __future__ import annotations

import dataclasses
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
from plait.config.schema import Config
from plait.launch import launch
from plait.train.checks import validate
from plait.train.progress import each
from plait.train.trainer import Trainer


def with_ep(cfg: Config, ep: int) -> Config:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=ep, dp=0))


@record
def bench_moe(cfg: Config, steps: int, warmup: int) -> dict | None:
    dims, mesh = start_worker(cfg)
    trainer = Trainer(cfg, dims, mesh, torch.device("cpu"))
    times, waits, moved, routing = [], [], [], []
    for step in range(warmup + steps):
        LEDGER.reset()
        start = time.perf_counter()
        trainer.train_step(step)
        elapsed = time.perf_counter() - start
        wait, nbytes = LEDGER.wait_by_op[Op.ALL_TO_ALL], float(LEDGER.bytes_by_op[Op.ALL_TO_ALL])
        metrics = trainer.moe.step()
        if step >= warmup:
            times.append(elapsed)
            waits.append(wait)
            moved.append(nbytes)
            routing.append(metrics)
    row = {"step_s": statistics.median(times), "all_to_all_s": statistics.median(waits),
           "all_to_all_bytes": statistics.median(moved),
           "dropped": statistics.fmean(m["dropped"] for m in routing),
           "max_load": max(m["max_load"] for m in routing),
           "load": {i: [statistics.fmean(m["layers"][i]["load"][e] for m in routing)
                        for e in range(cfg.model.args().moe_experts)]
                    for i in routing[0]["layers"]}}
    rank = dist.get_rank()
    dist.destroy_process_group()
    return row if rank == 0 else None


def draw_load(load: dict[str, list[float]], png: str) -> None:
    """One panel per MoE layer: assignments per expert and step, and the balanced mean."""
    # here, not at the top: matplotlib only where a picture is drawn
    import matplotlib

    matplotlib.use("Agg")
    # here, not at the top: matplotlib only where a picture is drawn
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(load), figsize=(3.2 * len(load), 2.8), squeeze=False)
    for ax, (layer, counts) in zip(axes[0], load.items(), strict=True):
        ax.bar(range(len(counts)), counts, color="tab:blue")
        ax.axhline(statistics.fmean(counts), color="tab:red", linestyle="--", label="mean")
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("expert")
        ax.set_xticks(range(len(counts)))
    axes[0][0].set_ylabel("tokens routed per step")
    axes[0][0].legend(loc="lower right")
    fig.suptitle("expert load (assignments kept)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def run_moe(nproc: int, cfg: Config, degrees: list[int], steps: int, warmup: int,
            png: str) -> list[dict]:
    """A mixture-of-experts recipe at each ep degree on `nproc` ranks (`bench_moe` above)."""

    configs = {ep: with_ep(cfg, ep) for ep in degrees}
    for c in configs.values():
        validate(c, nproc)  # every degree is checked before any worker starts
    rows = []
    for ep in each(degrees, "bench moe: ep"):
        rows.append({"ep": ep, "dp": nproc // ep, **launch(nproc, bench_moe, configs[ep], steps,
                                                           warmup)[0]})
    args = cfg.model.args()
    loop = next((r["step_s"] for r in rows if r["ep"] == 1), None)
    table = Table(title=(
        f"plait bench moe: {args.moe_experts} experts, top-{args.moe_top_k}, {args.moe_router}, "
        f"dim {args.dim} x {args.n_layers} layers, global batch {cfg.train.global_batch} x "
        f"{cfg.data.seq_len} tokens, {nproc} ranks; median of {steps} steps after {warmup}"))
    for col in ("ep", "dp", "step (ms)", "vs ep 1 (loop)", "all-to-all (ms)", "share of step",
                "all-to-all / step, rank 0", "dropped", "busiest / mean"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["ep"]), str(r["dp"]), f"{r['step_s'] * 1e3:,.1f}",
                      f"{r['step_s'] / loop:.2f}" if loop else "-",
                      f"{r['all_to_all_s'] * 1e3:,.1f}",
                      f"{r['all_to_all_s'] / r['step_s']:.1%}",
                      size_text(r["all_to_all_bytes"]) if r["all_to_all_bytes"] else "-",
                      f"{r['dropped']:.1%}", f"{r['max_load']:.2f}")
    Console(width=150).print(table)
    draw_load(rows[0]["load"], png)
    print(f"expert load histogram: {png}")
    return rows
