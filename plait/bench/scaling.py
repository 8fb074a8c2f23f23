"""`plait bench scaling [--nproc 1,2,4] [--weak] [--config FILE] [overrides]`: one recipe at each
world size, data parallelism taking the ranks (tp, pp and the rest as the recipe sets them).

    strong scaling (default)   the global batch fixed: more ranks, fewer rows each
    weak scaling (--weak)      the rows per data-parallel rank fixed: the global batch grows with
                               the ranks, from the recipe's at the first world size

Per world size, from the median step (the slowest rank's) after two warm-up steps: tokens/s,
speedup (tokens/s over the first world size's) and efficiency, speedup / (N / N0); for strong
scaling from N0 = 1 that is the usual T1 / (N * TN). Exposed communication is the share of the
step rank 0 spent blocked in collectives (the ledger's wait time): communication that backward
did not hide, and any wait for a slower rank. With data parallelism alone the PyTorch peer
(DistributedDataParallel, or its ZeRO / fully_shard counterpart, as in `bench step`) runs the
same batches in turns with plait, so both scale on the same machine state.
"""

from __future__ import annotations

import os
import statistics
import time

import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.elastic.multiprocessing.errors import record

from plait.bench.step import plait_step, start_worker, time_in_turns, torch_runner
from plait.comm import LEDGER
from plait.config.schema import Config, at_world, microbatches
from plait.data.batches import TokenData
from plait.launch import launch
from plait.model import build_model
from plait.train.progress import each


def has_torch_peer(cfg: Config) -> bool:
    par = cfg.parallel
    return par.tp == par.pp == 1 and par.compression == "none"


@record
def bench_scaling(cfg: Config, steps: int) -> dict | None:
    """On every rank: plait's step (and the peer's, with data parallelism alone) timed in turns;
    rank 0 returns the medians and its blocked-in-collectives share."""
    dims, mesh = start_worker(cfg)
    step = plait_step(cfg, dims, mesh)
    shares = []

    def plait():
        LEDGER.reset()
        start = time.perf_counter()
        step()
        shares.append(LEDGER.wait_s / (time.perf_counter() - start))

    runners = {"plait": plait}
    if has_torch_peer(cfg):
        x, y = TokenData(cfg.data, cfg.train.seed).batch(0, cfg.train.global_batch,
                                                         mesh["dp"].get_local_rank(), dims.dp)
        micro = len(x) // microbatches(cfg.parallel, dims)
        batches = list(zip(x.split(micro), y.split(micro), strict=True))
        runners["torch"] = torch_runner(build_model(cfg.model.args(), cfg.train.seed), mesh,
                                         cfg, batches).step
    medians = time_in_turns(runners, dist.group.WORLD, steps)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank:
        return None
    return {**medians, "exposed": statistics.median(shares[2:] or shares)}


def scaling_rows(results: list[tuple[int, Config, dict]]) -> list[dict]:
    """Tokens/s, speedup and efficiency against the first world size, for plait and the peer."""
    n0, cfg0, base = results[0]
    rows = []
    for n, cfg, t in results:
        tokens = cfg.train.global_batch * cfg.data.seq_len
        row = {"ranks": n, "global_batch": cfg.train.global_batch, "exposed": t["exposed"]}
        for who in ("plait", "torch"):
            if who in t:
                tps = tokens / t[who]
                tps0 = cfg0.train.global_batch * cfg0.data.seq_len / base[who]
                row[who] = {"step_s": t[who], "tokens_per_s": tps, "speedup": tps / tps0,
                            "efficiency": tps / tps0 / (n / n0)}
        rows.append(row)
    return rows


def draw_speedup(rows: list[dict], title: str, png: str, cores: int) -> None:
    # here, not at the top: matplotlib only where a picture is drawn
    import matplotlib

    matplotlib.use("Agg")
    # here, not at the top: matplotlib only where a picture is drawn
    import matplotlib.pyplot as plt

    ranks = [r["ranks"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot(ranks, [n / ranks[0] for n in ranks], "k--", lw=1, label="ideal")
    for who, style in (("plait", "o-"), ("torch", "s-")):
        if all(who in r for r in rows):
            ax.plot(ranks, [r[who]["speedup"] for r in rows], style, label=who)
    if ranks[-1] > cores:  # where the numbers stop meaning scaling
        ax.axvspan(cores, ranks[-1], color="grey", alpha=0.15, label="more ranks than cores")
    ax.set(xlabel="ranks", ylabel="speedup (tokens/s over the first)", xticks=ranks,
           title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def run_scaling(sizes: list[int], cfg: Config, steps: int, weak: bool, png: str) -> list[dict]:
    """The recipe at each world size (`bench_scaling` above); a table and the speedup picture."""

    # every world size was checked by the command before it imported this module (torch)
    configs = {n: at_world(cfg, n, sizes[0], weak) for n in sizes}
    cores = os.cpu_count() or 1
    if sizes[-1] > cores:
        Console(stderr=True).print(
            f"[yellow]warning:[/] {sizes[-1]} ranks on {cores} cores: from {cores + 1} ranks on, "
            "ranks share cores, so those rows measure contention for the cores, not scaling")
    results = []
    for n in each(sizes, "bench scaling: ranks"):
        c = configs[n]
        results.append((n, c, launch(n, bench_scaling, c, steps, threads=c.train.threads)[0]))
    rows = scaling_rows(results)
    args, kind = cfg.model.args(), "weak" if weak else "strong"
    batch = (f"{cfg.train.global_batch // sizes[0]} rows per rank" if weak
             else f"global batch {cfg.train.global_batch}")
    title = (f"plait bench scaling ({kind}): model dim {args.dim} x {args.n_layers} layers, "
             f"{batch} x {cfg.data.seq_len} tokens; median of {steps} steps; {cores} cores")
    table = Table(title=title)
    for col in ("ranks", "batch", "plait tok/s", "speedup", "efficiency", "exposed comm",
                "torch tok/s", "torch speedup", "torch efficiency", "plait / torch"):
        table.add_column(col, justify="right")
    for r in rows:
        p, t = r["plait"], r.get("torch")
        peer = ([f"{t['tokens_per_s']:,.0f}", f"{t['speedup']:.2f}", f"{t['efficiency']:.0%}",
                 f"{p['step_s'] / t['step_s']:.3f}"] if t else ["-"] * 4)
        table.add_row(str(r["ranks"]), str(r["global_batch"]), f"{p['tokens_per_s']:,.0f}",
                      f"{p['speedup']:.2f}", f"{p['efficiency']:.0%}", f"{r['exposed']:.1%}",
                      *peer)
    Console(width=140).print(table)
    draw_speedup(rows, f"{kind} scaling, {cores} cores", png, cores)
    Console().print(f"speedup: {png}")
    return rows
