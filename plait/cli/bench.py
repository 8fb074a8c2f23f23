"""`plait bench comm | step | pp | compression | scaling | checkpoint | moe | cp | memory | data
| plan | topology [--nproc N] [--config FILE] [key=value ...]`: the benchmark suites' options and
commands (`plait.bench` runs them). Like every command, bad input exits with status 2 and one
line before any worker starts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from plait.cli.common import check_output_path, load, recipe_path
from plait.config.choices import COMPRESSIONS, CP_METHODS
from plait.config.schema import ConfigError, at_world, cp_variants, load_config, with_cp
from plait.nodes import available
from plait.train.checks import validate


def cmd_bench_comm(args: argparse.Namespace) -> None:
    if args.nproc < 2:
        raise ConfigError("--nproc", f"a collective needs at least 2 ranks, got {args.nproc}")
    if not 0 < args.min_seconds <= 60:
        raise ConfigError("--min-seconds", f"seconds per size in (0, 60], got "
                          f"{args.min_seconds:g}")
    # here, not at the top: the command line's refusals import no torch
    from plait.bench.comm import run_comm

    run_comm(args.nproc, args.min_seconds)


def cmd_bench_gemm(args: argparse.Namespace) -> None:
    check_output_path(args.out, "--out")
    if args.steps < 1:
        raise ConfigError("--steps", f"need at least one timed product per shape, got "
                          f"{args.steps}")
    if args.fp8:
        # here, not at the top: the command line's refusals import no torch
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--fp8", "fp8 matmuls need a GPU with fp8 tensor cores; this "
                              "machine has none")
    # here, not at the top: the command line's refusals import no torch
    from plait.bench.gemm import run_gemm

    run_gemm(args.out, args.fp8, repeats=args.steps)


def cmd_bench_step(args: argparse.Namespace) -> None:
    if args.nproc < 1:
        raise ConfigError("--nproc", f"need at least one process, got {args.nproc}")
    if args.steps < 1:
        raise ConfigError("--steps", f"need at least one timed step, got {args.steps}")
    if args.repeats < 1:
        raise ConfigError("--repeats", f"at least 1 launch per side, got {args.repeats}")
    # here, not at the top: the command line's refusals import no torch
    from plait.bench.step_runs import run_step

    run_step(args.nproc, load(args), args.steps, args.repeats)


def cmd_bench_gpu(args: argparse.Namespace) -> None:
    sides = tuple(s.strip() for s in args.sides.split(",") if s.strip())
    known = ("plait", "plait-compiled", "plait-hf", "loop", "loop-compiled")
    if not sides or set(sides) - set(known):
        raise ConfigError("--sides", f"comma-separated, from {', '.join(known)}; got "
                          f"{args.sides!r}")
    if args.steps < 1 or args.warmup < 2:
        raise ConfigError("--warmup", f"need >= 1 timed steps after >= 2 warm-up steps (the "
                          f"first compiles, the second makes the optimizer's state), got "
                          f"{args.steps} after {args.warmup}")
    if args.json_out:
        check_output_path(args.json_out, "--json")
    # here, not at the top: the command line's refusals import no torch
    import torch

    if args.shape == "1b" and not torch.cuda.is_available():
        raise ConfigError("--shape", "the 1b shape is for a GPU and this machine has none; "
                          "use --shape tiny")
    # here, not at the top: the command line's refusals import no torch
    from plait.bench.gpu import run_gpu, shape_config

    cfg = shape_config(args.shape, [f"train.compile_backend='{args.compile_backend}'",
                                    *args.overrides])
    run_gpu(cfg, args.warmup, args.steps, sides, args.json_out)


def cmd_bench_pp(args: argparse.Namespace) -> None:
    if args.nproc < 2:
        raise ConfigError("--nproc", f"a pipeline needs at least 2 stages, got {args.nproc}")
    if args.steps < 1:
        raise ConfigError("--steps", f"need at least one timed step, got {args.steps}")
    check_output_path(args.png, "--png")
    # here, not at the top: the command line's refusals import no torch
    from plait.bench.pp import run_pp

    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    run_pp(args.nproc, load(args), args.steps, args.png)


def cmd_bench_compression(args: argparse.Namespace) -> None:
    if args.nproc < 2:
        raise ConfigError("--nproc", f"compression needs data parallelism: >= 2, got {args.nproc}")
    methods = list(COMPRESSIONS) if args.methods is None else \
        [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in COMPRESSIONS]
    if unknown or not methods:
        raise ConfigError("--methods", f"comma-separated names from {', '.join(COMPRESSIONS)}; "
                          f"got {args.methods!r}")
    check_output_path(args.png, "--png")
    # here, not at the top: the command line's refusals import no torch
    from plait.bench.compression import run_compression

    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    run_compression(args.nproc, load(args), methods, args.png)


# A few hundred million parameters: the model of #30's report (304M, 1.16 GiB in fp32).
MEMORY_MODEL = ["model.preset=small", "model.dim=1024", "model.n_layers=24", "model.n_heads=8",
                "model.n_kv_heads=8", "model.vocab_size=256", "data.seq_len=32",
                "train.global_batch=8", "data.max_bytes=200000"]


def cmd_bench_memory(args: argparse.Namespace) -> None:
    layouts = [(f"ZeRO-3 dp{n}", n, ["parallel.zero=3"]) for n in (2, 4, 8)]
    layouts.append(("dp2 x tp2 x pp2, ZeRO-1", 8, ["parallel.tp=2", "parallel.pp=2",
                                                   "parallel.zero=1"]))
    configs = [(name, load_config(None, [*MEMORY_MODEL, *extra, *args.overrides]), n)
               for name, n, extra in layouts]
    # here, not at the top: the command line's refusals import no torch
    from plait.bench.memory import run_memory

    run_memory(configs)


DATA_MODEL = ["model.preset=tiny", "model.vocab_size=4096", "train.global_batch=16",
              "data.seq_len=64"]


def _counts(text: str, option: str) -> list[int]:
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ConfigError(option, f"positive whole numbers, comma-separated; got {text!r}")
    return counts


def cmd_bench_data(args: argparse.Namespace) -> None:
    sizes, workers = _counts(args.sizes_mb, "--sizes-mb"), _counts(args.workers, "--workers")
    launch_gb = _counts(args.launch_gb, "--launch-gb")
    if args.steps < 2:
        raise ConfigError("--steps", f"at least 2 (the first is warm-up), got {args.steps}")
    cfg = load_config(None, [*DATA_MODEL, *args.overrides])
    # here, not at the top: the command line's refusals import no torch
    from plait.bench.data import run_data, run_launch

    run_data(cfg, args.nproc, sizes, workers, args.steps, Path(args.dir))
    run_launch([*DATA_MODEL, *args.overrides], launch_gb, Path(args.dir))


def cmd_bench_checkpoint(args: argparse.Namespace) -> None:
    if args.repeats < 1:
        raise ConfigError("--repeats", f"at least 1, got {args.repeats}")
    recipes = []
    for name, nproc in (("default", 4), ("3d", 8)):
        cfg = load_config(recipe_path(name), args.overrides)
        recipes.append((name, cfg, nproc))
    # here, not at the top: the command line's refusals import no torch
    from plait.bench.checkpoint import run_checkpoint

    run_checkpoint(recipes, args.repeats)


def cmd_bench_scaling(args: argparse.Namespace) -> None:
    try:
        sizes = [int(n) for n in args.nproc.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or sizes != sorted(set(sizes)):
        raise ConfigError("--nproc", "increasing world sizes >= 1, comma-separated (1,2,4); got "
                          f"{args.nproc!r}")
    if args.steps < 1:
        raise ConfigError("--steps", f"need at least one timed step, got {args.steps}")
    check_output_path(args.png, "--png")
    cfg = load(args)

    for n in sizes:  # every world size before any worker, and before the bench imports torch
        validate(at_world(cfg, n, sizes[0], args.weak), n)
    # here, not at the top: the command line's refusals import no torch
    from plait.bench.scaling import run_scaling

    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    run_scaling(sizes, cfg, args.steps, args.weak, args.png)


def cmd_bench_moe(args: argparse.Namespace) -> None:
    try:
        degrees = [int(n) for n in args.ep.split(",")]
    except ValueError:
        degrees = []
    if not degrees or min(degrees) < 1 or any(args.nproc % d for d in degrees):
        raise ConfigError("--ep", f"degrees >= 1 dividing --nproc={args.nproc}, comma-separated "
                          f"(1,2,4); got {args.ep!r}")
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError("--steps", f"need >= 1 timed steps after >= 0 warm-up steps, got "
                          f"{args.steps} after {args.warmup}")
    check_output_path(args.png, "--png")
    # here, not at the top: the command line's refusals import no torch
    from plait.bench.moe import run_moe

    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    run_moe(args.nproc, load(args), degrees, args.steps, args.warmup, args.png)


def cmd_bench_cp(args: argparse.Namespace) -> None:
    try:
        degrees = [int(n) for n in args.cp.split(",")]
    except ValueError:
        degrees = []
    if not degrees or min(degrees) < 2:
        raise ConfigError("--cp", f"degrees >= 2, comma-separated (2,4); got {args.cp!r}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or set(methods) - set(CP_METHODS):
        raise ConfigError("--methods", f"comma-separated, from {', '.join(CP_METHODS)}; got "
                          f"{args.methods!r}")
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError("--steps", f"need >= 1 timed steps after >= 0 warm-up steps, got "
                          f"{args.steps} after {args.warmup}")
    cfg = load(args)

    for c, m in cp_variants(degrees, methods):  # before any worker, and before torch's import
        validate(with_cp(cfg, c, m), c)
    # here, not at the top: the command line's refusals import no torch
    from plait.bench.cp import run_cp

    run_cp(cfg, degrees, methods, args.steps, args.warmup)


def cmd_bench_plan(args: argparse.Namespace) -> None:
    if args.which not in ("all", "measured", "published"):
        raise ConfigError("--which", f"measured, published or all; got {args.which!r}")
    if args.steps < 1:
        raise ConfigError("--steps", f"at least 1 timed step, got {args.steps}")
    # here, not at the top: the command line's refusals import no torch
    from plait.bench.planner import run_plan_bench

    run_plan_bench(args.steps, args.which)


def cmd_bench_topology(args: argparse.Namespace) -> None:

    ratios = _counts(args.ratios, "--ratios")
    if args.steps < 1:
        raise ConfigError("--steps", f"at least 1 timed step, got {args.steps}")
    check_output_path(args.out, "--out")
    why = available()
    if why:
        raise ConfigError("bench topology", f"emulated nodes cannot be made here: {why}")
    # here, not at the top: the command line's refusals import no torch
    from plait.bench.topology import run_topology

    found = run_topology(args.steps, ratios, quiet=args.json, out=args.out)
    if args.json:
        print(json.dumps(found["rows"], indent=1))
