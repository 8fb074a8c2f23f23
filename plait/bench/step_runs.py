"""`plait bench step`, the launcher's side: each side (plait, the PyTorch-native peer) in
processes of its own, launched by turns (`in_turns`), and the tables: DDP and ZeRO at each world
size, tensor parallelism against DTensor, the 3-D composition against torch's. The workers are in
step.py, tp.py and threed.py."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from plait import forkserver
from plait.bench.load import BUSY, OtherLoad
from plait.bench.muon import run_muon_step
from plait.bench.step import NO_COMM, SIDES, bench_step, summarize, with_free_dp, world_sizes
from plait.bench.threed import TORCH_SCHEDULES, bench_3d
from plait.bench.tp import bench_tp
from plait.config.schema import Config, ConfigError, microbatches
from plait.launch import launch
from plait.train.checks import validate
from plait.train.progress import each


def run_step(nproc: int, cfg: Config, steps: int, repeats: int = 2) -> list[dict]:
    if cfg.model.hf and cfg.parallel.pp > 1:
        raise ConfigError("parallel.pp", "bench step compares a Hugging Face model's DDP, ZeRO "
                          "and TP steps with torch's; set pp = 1")
    if cfg.train.optimizer == "muon":

        return run_muon_step(nproc, cfg, steps, repeats)
    if cfg.parallel.pp > 1:
        return run_3d_step(nproc, cfg, steps, repeats)
    if cfg.parallel.tp > 1:
        return run_tp_step(nproc, cfg, steps, repeats)
    cfg = with_free_dp(cfg)
    for n in world_sizes(nproc):
        validate(cfg, n)  # every world size is checked before any worker starts
    rows = [_step_row(n, cfg, steps, repeats)
            for n in each(world_sizes(nproc), "bench step: ranks")]
    t1 = {k: rows[0][k] for k in ("plait", "torch")}
    args = cfg.model.args()
    zero = cfg.parallel.zero
    engine = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[zero]
    peer = {0: "torch DDP", 3: "torch fully_shard"}.get(zero, "torch ZeroRedundancyOptimizer")
    precision = cfg.train.precision
    if precision != "fp32":
        engine, peer = f"{engine} {precision}", f"{peer} {precision}"
    if precision == "fp16":
        peer += " + " + ("ShardedGradScaler" if zero == 3 else "GradScaler")
    hf = bool(cfg.model.hf)
    model = f"Hugging Face {cfg.model.hf} (transformers' modules), " if hf else "model "
    table = Table(title=(
        f"plait bench step: plait {engine} vs {peer}; {model}dim {args.dim} x {args.n_layers} "
        f"layers, global batch {cfg.train.global_batch} x {cfg.data.seq_len} tokens, bucket "
        f"{cfg.parallel.bucket_mb} MB, all-reduce {cfg.parallel.allreduce}; median of {steps} "
        "steps" + ("; and plait's own Llama of the same shape, same layout" if hf else "")))
    columns = ["ranks", "plait (ms)", "spread", "torch (ms)", "spread", "plait / torch",
               "exposed comm", "scaling plait", "scaling torch", "other load"]
    for col in columns + (["plait's Llama (ms)", "HF / plait's Llama"] if hf else []):
        table.add_column(col, justify="right")
    for r in rows:
        n = r["ranks"]
        r["ratio"] = r["plait"] / r["torch"]
        r["exposed"] = max(0.0, r["plait"] - r["no_comm"]) / r["plait"] if "no_comm" in r else None
        r["scaling_plait"] = t1["plait"] / (n * r["plait"])
        r["scaling_torch"] = t1["torch"] / (n * r["torch"])
        cells = [str(n), f"{r['plait'] * 1e3:,.1f}", f"{r['plait_spread']:.1%}",
                 f"{r['torch'] * 1e3:,.1f}", f"{r['torch_spread']:.1%}", f"{r['ratio']:.3f}",
                 f"{r['exposed']:.1%}" if n > 1 and r["exposed"] is not None else "-",
                 f"{r['scaling_plait']:.2f}", f"{r['scaling_torch']:.2f}",
                 f"{r['other_load']:.0%}" + (" !" if r["other_load"] > BUSY else "")]
        if hf:
            r["hf_vs_llama"] = r["plait"] / r["llama"]
            cells += [f"{r['llama'] * 1e3:,.1f}", f"{r['hf_vs_llama']:.3f}"]
        table.add_row(*cells)
    Console(width=140).print(table)
    _say_load(rows)
    return rows


def _step_row(n: int, cfg: Config, steps: int, repeats: int) -> dict:
    """`bench step` at `n` ranks, its sides isolated (`in_turns`); a DDP row (and only it has
    one) with plait's DDP without communication, in processes of its own as well."""
    sides = SIDES if cfg.parallel.zero or n == 1 else (*SIDES, NO_COMM)
    return {"ranks": n, **in_turns(n, bench_step, cfg, steps, repeats, sides)}


def in_turns(n: int, worker, cfg: Config, steps: int, repeats: int,
             sides: tuple[str, ...] = SIDES) -> dict:
    """A bench's sides (`worker(cfg, steps, side)` for each of `sides`: rank 0 returns each of
    its step functions' times and the glibc threshold its process set), each side in processes
    of its own with the environment a user of that side has, launched by turns over `repeats`
    launches (the order reversed every other launch), the steps pooled: each name's median and
    spread (`summarize`), the machine's other load meanwhile, each side's threshold."""
    times, thresholds = {}, {}
    with OtherLoad() as load:
        for repeat in range(repeats):
            for side in sides if repeat % 2 == 0 else sides[::-1]:
                got = launch(n, worker, cfg, steps, side, threads=cfg.train.threads,
                             preload=forkserver.HF if cfg.model.hf else ())[0]
                thresholds[side] = got.pop("malloc_threshold")
                for name, ts in got.items():
                    times.setdefault(name, []).extend(ts)
    return {**summarize(times), "other_load": load.share, "malloc_threshold": thresholds}


def _variants_table(table: Table, rows: list[tuple[str, str]], t: dict) -> list[dict]:
    """Rows of (variant, name in `t`) with their median, spread and ratio to torch's, then the
    other load's line."""
    for col in ("variant", "step (ms)", "spread", "plait / torch"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for variant, name in rows:
        table.add_row(variant, f"{t[name] * 1e3:,.1f}", f"{t[name + '_spread']:.1%}",
                      f"{t[name] / t['torch']:.3f}")
    Console(width=120).print(table)
    load = t["other_load"]
    Console().print(f"spread: interquartile range / median of the timed steps; other load: "
                    f"{load:.0%} of the cores used by other processes during the bench" + (
                        f" [yellow](more than {BUSY:.0%}: measure again on a quiet machine)[/]"
                        if load > BUSY else ""))
    return [{"variant": variant, "seconds": t[name], "spread": t[name + "_spread"],
             "other_load": load, "malloc_threshold": t["malloc_threshold"]}
            for variant, name in rows]


def _say_load(rows: list[dict]) -> None:
    """Spread: the interquartile range of a side's steps over its median. Other load: the share of
    the cores other processes used while the row ran (bench/load.py); a row above `BUSY` is
    marked "!" and named, its ratio not to be trusted."""
    busy = [r for r in rows if r["other_load"] > BUSY]
    Console().print("spread: interquartile range / median of the timed steps; other load: "
                    "other processes' share of the cores during the row" + (
                        f"; [yellow]rows {', '.join(str(r['ranks']) for r in busy)} ran with "
                        f"more than {BUSY:.0%} of the machine busy elsewhere: measure them "
                        "again on a quiet machine[/]" if busy else ""))


def run_tp_step(nproc: int, cfg: Config, steps: int, repeats: int = 2) -> list[dict]:
    tp = cfg.parallel.tp
    if nproc != tp:
        raise ConfigError("--nproc", f"the tensor-parallel bench runs tp alone: use --nproc {tp}")
    if cfg.data.seq_len % tp:
        raise ConfigError("data.seq_len", f"tp={tp} must divide it (the bench also runs SP)")
    cfg = with_free_dp(cfg)
    validate(cfg, nproc)
    t = in_turns(nproc, bench_tp, cfg, steps, repeats)
    args = cfg.model.args()
    model = f"Hugging Face {cfg.model.hf}, " if cfg.model.hf else "model "
    table = Table(title=(
        f"plait bench step, tensor parallel: tp {tp}, {model}dim {args.dim} x {args.n_layers} "
        f"layers, batch {cfg.train.global_batch} x {cfg.data.seq_len} tokens; median of "
        f"{steps} x {repeats} steps, each side in its own processes"))
    return _variants_table(table, [("plait TP", "plait"),
                                   ("plait TP + sequence parallel", "plait_sp"),
                                   ("torch DTensor TP (parallelize_module)", "torch")], t)


def run_3d_step(nproc: int, cfg: Config, steps: int, repeats: int = 2) -> list[dict]:
    """plait's composition against torch's (pipelining + DTensor TP + fully_shard), N ranks."""

    cfg = with_free_dp(cfg)
    dims = validate(cfg, nproc)
    if cfg.parallel.pp_schedule not in TORCH_SCHEDULES:
        raise ConfigError("parallel.pp_schedule", f"torch.distributed.pipelining has no peer for "
                          f"'{cfg.parallel.pp_schedule}'; one of {', '.join(TORCH_SCHEDULES)}")
    t = in_turns(nproc, bench_3d, cfg, steps, repeats)
    args, par = cfg.model.args(), cfg.parallel
    table = Table(title=(
        f"plait bench step, 3-D: pp {dims.pp} x dp {dims.dp} x tp {dims.tp}, {par.pp_schedule}, "
        f"{microbatches(par, dims)} micro-batches; model dim {args.dim} x {args.n_layers} layers, "
        f"batch {cfg.train.global_batch} x {cfg.data.seq_len} tokens; median of {steps} x "
        f"{repeats} steps, each side in its own processes"))
    rows = [(f"plait ZeRO-{par.zero}" if par.zero else "plait DDP", "plait")]
    if "plait_zero3" in t:
        rows.append(("plait ZeRO-3", "plait_zero3"))
    rows.append(("torch pipelining + parallelize_module + fully_shard", "torch"))
    return _variants_table(table, rows, t)
