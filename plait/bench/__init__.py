"""`plait bench ...`: each suite launches its own workers and prints a table from rank 0's results.
Timings live here, never in tests."""

from __future__ import annotations

import dataclasses
import os
import tempfile

from rich.console import Console
from rich.table import Table

from plait.bench.checkpoint import bench_checkpoint
from plait.bench.comm import SIZES, bench_comm
from plait.bench.cp import bench_cp
from plait.bench.memory import bench_memory
from plait.bench.moe import bench_moe, draw_load, with_ep
from plait.bench.pp import (
    bench_pp,
    measured_bubble,
    replayed,
    stage_costs,
    why_bubble,
    with_schedule,
)
from plait.bench.scaling import bench_scaling, draw_speedup, scaling_rows
from plait.bench.step import with_free_dp
from plait.config.choices import PP_SCHEDULES
from plait.config.schema import Config, ConfigError, at_world, cp_variants, with_cp
from plait.launch import launch
from plait.parallel.pipeline.schedules import build_schedule
from plait.parallel.pipeline.simulator import simulate, textbook_bubble
from plait.train.checks import validate
from plait.train.progress import each
from plait.train.report import draw_timelines


def run_comm(nproc: int, min_seconds: float = 0.2) -> list[dict]:
    rows = launch(nproc, bench_comm, SIZES, min_seconds)[0]
    table = Table(title=f"plait bench comm: {nproc} ranks, gloo on loopback "
                        "(nccl-tests definitions: algbw = S/t, busbw = algbw x bus factor)")
    for col in ("collective", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
        table.add_column(col, justify="left" if col == "collective" else "right")
    for r in rows:
        table.add_row(r["collective"], _size(r["bytes"]), f"{r['time_us']:,.0f}",
                      f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}")
    Console(width=120).print(table)
    return rows


def run_pp(nproc: int, cfg: Config, steps: int, png: str) -> list[dict]:
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=nproc, dp=0))
    schedules, skipped = [], []
    for name in PP_SCHEDULES:
        try:
            validate(with_schedule(cfg, name), nproc)
            schedules.append(name)
        except ConfigError as e:
            if name != "interleaved":
                raise
            skipped.append(f"{name}: {e}")
    if not schedules:
        raise ConfigError("parallel.pp", "no schedule fits this model and batch")
    per_rank = launch(nproc, bench_pp, cfg, schedules, steps, threads=cfg.train.threads)
    M = cfg.parallel.microbatches or nproc
    table = Table(title=f"plait bench pp: {nproc} stages, {M} micro-batches, median of {steps} "
                        "steps (bubbles: idle share of the step, worst stage)")
    for col in ("schedule", "simulated bubble", "formula", "replayed", "measured bubble",
                "peak in-flight", "plait (ms)", "torch (ms)", "plait / torch"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    rows, timelines, why = [], {}, []
    for name in schedules:
        sim = build_schedule(name, nproc, M, cfg.parallel.pp_virtual)
        timeline = simulate(sim)
        spans = [r[name]["spans"] for r in per_rank]
        timelines[name] = spans
        plait_s, torch_s = per_rank[0][name]["plait"], per_rank[0][name]["torch"]
        row = {"schedule": name, "simulated": timeline.bubble, "formula": textbook_bubble(sim),
               "replayed": replayed(sim, spans).bubble, "measured": measured_bubble(spans),
               "peak": max(timeline.peak_in_flight), "plait": plait_s, "torch": torch_s}
        rows.append(row)
        why.append(why_bubble(name, row["formula"], row["replayed"], row["measured"],
                              stage_costs(spans)))
        table.add_row(name, f"{row['simulated']:.3f}", f"{row['formula']:.3f}",
                      f"{row['replayed']:.3f}", f"{row['measured']:.3f}", str(row["peak"]),
                      f"{plait_s * 1e3:,.1f}", f"{torch_s * 1e3:,.1f}" if torch_s else "-",
                      f"{plait_s / torch_s:.3f}" if torch_s else "-")
    Console(width=130).print(table)
    for line in why:
        Console(width=130).print(line, soft_wrap=True)
    for note in skipped:
        Console().print(f"skipped {note}")
    draw_timelines(timelines, png)
    Console().print(f"timelines: {png}")
    return rows


def run_compression(nproc: int, cfg: Config, methods: list[str], png: str) -> list[dict]:
    """Each method on the same recipe, then torch's hooks (see bench/compression.py)."""
    # here, not at the top: torch's communication hooks only for bench compression
    from plait.bench.compression import (
        PEERS,
        bench_plait,
        bench_torch_hook,
        draw_curves,
        final_loss,
        with_method,
    )

    cfg = with_free_dp(cfg)
    for method in methods:
        validate(with_method(cfg, method), nproc)
    runs = {}
    for name in each([*methods, *PEERS], "bench compression: training with"):
        if name in PEERS:
            runs[name] = launch(nproc, bench_torch_hook, cfg, name, threads=cfg.train.threads)[0]
        else:
            runs[name] = launch(nproc, bench_plait, with_method(cfg, name),
                                threads=cfg.train.threads)[0]
    base = runs.get("none")
    args, par = cfg.model.args(), cfg.parallel
    table = Table(title=(
        f"plait bench compression: {nproc} ranks, model dim {args.dim} x {args.n_layers} layers, "
        f"{cfg.train.steps} steps of {cfg.train.global_batch} x {cfg.data.seq_len} tokens; topk "
        f"ratio {par.compression_ratio}, PowerSGD rank {par.compression_rank}, start "
        f"{par.compression_start}; train loss: mean of the last 10 steps"))
    for col in ("method", "train loss", "val loss", "val gap", "bytes/step", "bytes ratio",
                "step (ms)"):
        table.add_column(col, justify="left" if col == "method" else "right")
    rows = []
    for name, run in runs.items():
        row = {"method": name, "train_loss": final_loss(run["losses"]),
               "val_loss": run["val_loss"], "bytes": run["bytes"], "step_s": run["step_s"]}
        row["val_gap"] = run["val_loss"] / base["val_loss"] - 1 if base else None
        row["bytes_ratio"] = run["bytes"] / base["bytes"] if base and run["bytes"] else None
        rows.append(row)
        table.add_row(name, f"{row['train_loss']:.4f}", f"{row['val_loss']:.4f}",
                      f"{row['val_gap']:+.1%}" if row["val_gap"] is not None else "-",
                      _size(int(run["bytes"])) if run["bytes"] is not None else "-",
                      f"{row['bytes_ratio']:.3f}" if row["bytes_ratio"] is not None else "-",
                      f"{run['step_s'] * 1e3:,.1f}")
    Console(width=140).print(table)
    draw_curves(runs, png)
    Console().print(f"loss curves: {png}")
    return rows


def run_scaling(sizes: list[int], cfg: Config, steps: int, weak: bool, png: str) -> list[dict]:
    """The recipe at each world size (bench/scaling.py); a table and the speedup picture."""

    # every world size was checked by the command before it imported this package (torch)
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


def run_checkpoint(recipes: list[tuple[str, Config, int]], repeats: int) -> list[dict]:
    """Save and load costs per rank of each (name, config, world size): bench/checkpoint.py."""

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
        table.add_row(name, str(nproc), f"{_size(sizes[0])} - {_size(sizes[-1])}",
                      *(f"{worst[k] * 1e3:,.1f}" for k in ("sync", "blocked", "copy", "async",
                                                            "load")))
        out.append({"recipe": name, "ranks": nproc, **worst, "bytes": sizes})
    Console(width=140).print(table)
    return out


def run_memory(layouts: list[tuple[str, Config, int]]) -> list[dict]:
    """Each (name, config, world size)'s per-rank peak host memory: bench/memory.py."""

    for _, cfg, nproc in layouts:
        validate(cfg, nproc)  # every layout is checked before any worker starts
    out = []
    for name, cfg, nproc in layouts:
        rows = launch(nproc, bench_memory, cfg, threads=cfg.train.threads)[0]
        worst = max(rows, key=lambda r: r["steady"])
        out.append({"layout": name, "ranks": nproc, **worst})
    first = out[0]
    args = layouts[0][1].model.args()
    table = Table(title=(
        f"plait bench memory: dim {args.dim} x {args.n_layers} layers, "
        f"{first['whole_fp32'] / 4 / 1e6:,.0f}M parameters ({_size(first['whole_fp32'])} in "
        "fp32, what every rank built before #30); peak resident memory over the baseline, "
        "the rank that grew most"))
    for col in ("layout", "ranks", "baseline", "building", "formula", "through step 1",
                "formula", f"through step {first['steps']}", "held after the steps",
                "peak / whole fp32"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in out:
        table.add_row(r["layout"], str(r["ranks"]), _size(r["baseline"]), _size(r["built"]),
                      _size(r["startup_formula"]), _size(r["stepped"]),
                      _size(r["step_formula"]), _size(r["steady"]), _size(r["held"]),
                      f"{r['steady'] / r['whole_fp32']:.2f}")
    Console(width=150).print(table)
    return out


def run_moe(nproc: int, cfg: Config, degrees: list[int], steps: int, warmup: int,
            png: str) -> list[dict]:
    """A mixture-of-experts recipe at each ep degree on `nproc` ranks: bench/moe.py."""

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
                      _size(r["all_to_all_bytes"]) if r["all_to_all_bytes"] else "-",
                      f"{r['dropped']:.1%}", f"{r['max_load']:.2f}")
    Console(width=150).print(table)
    draw_load(rows[0]["load"], png)
    print(f"expert load histogram: {png}")
    return rows


def run_cp(cfg: Config, degrees: list[int], methods: list[str], steps: int,
           warmup: int) -> list[dict]:
    """One long sequence per step on one rank, then over C ranks by each method: bench/cp.py."""

    # every variant was checked by the command before it imported this package (torch)
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
                      _size(r["cp_bytes"]) if r["cp_bytes"] else "-",
                      _size(r["activation_bytes"]), _size(r["activation_formula"]),
                      f"{r['activation_bytes'] / one['activation_bytes']:.2f}")
    Console(width=150).print(table)
    return rows


def _size(n: int) -> str:
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.1f} KiB"


__all__ = ["run_checkpoint", "run_comm", "run_compression", "run_cp", "run_moe", "run_pp",
           "run_scaling", "run_step"]
