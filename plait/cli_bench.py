"""`plait bench comm | step | pp | compression | scaling | checkpoint | moe | cp | memory | data
| plan | topology [--nproc N] [--config FILE] [key=value ...]`: the benchmark suites' options and
commands (`plait.bench` runs them). Like every command, bad input exits with status 2 and one
line before any worker starts."""

from __future__ import annotations

import argparse
from pathlib import Path

from plait.cli_common import check_output_path, load, recipe_path
from plait.comm.compression import METHODS
from plait.config import ConfigError, load_config


def add_bench(sub, parser_class) -> None:
    bench = sub.add_parser("bench", help="benchmarks against the PyTorch-native peers")
    suites = bench.add_subparsers(dest="suite", required=True, parser_class=parser_class)
    comm = suites.add_parser("comm", help="bandwidth of each collective and all-reduce algorithm")
    comm.add_argument("--nproc", type=int, default=4)
    comm.add_argument("--min-seconds", type=float, default=0.2, help="time per size and collective")
    comm.set_defaults(func=cmd_bench_comm)
    step = suites.add_parser("step", help="plait's step against PyTorch's own: DDP, ZeRO, TP, 3-D")
    step.add_argument("--nproc", type=int, default=4)
    step.add_argument("--config", help="a TOML file, or the name of a recipe in configs/")
    step.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    step.add_argument("overrides", nargs="*", metavar="section.key=value")
    step.set_defaults(func=cmd_bench_step)
    pp = suites.add_parser("pp", help="pipeline schedules: bubbles, memory, vs torch pipelining")
    pp.add_argument("--nproc", type=int, default=2, help="pipeline stages")
    pp.add_argument("--config", help="a TOML file, or the name of a recipe in configs/")
    pp.add_argument("--steps", type=int, default=5, help="timed steps per schedule")
    pp.add_argument("--png", default="runs/bench_pp/timeline.png", help="timeline picture")
    pp.add_argument("overrides", nargs="*", metavar="section.key=value")
    pp.set_defaults(func=cmd_bench_pp)
    squeeze = suites.add_parser("compression", help="each gradient compression method on one "
                                "recipe: loss, bytes, time; vs torch's DDP hooks")
    squeeze.add_argument("--nproc", type=int, default=4)
    squeeze.add_argument("--config", help="a TOML file, or the name of a recipe in configs/")
    squeeze.add_argument("--methods", default=",".join(METHODS),
                         help=f"comma-separated, from {', '.join(METHODS)}")
    squeeze.add_argument("--png", default="runs/bench_compression/loss.png",
                         help="loss curves picture")
    squeeze.add_argument("overrides", nargs="*", metavar="section.key=value")
    squeeze.set_defaults(func=cmd_bench_compression)
    scaling = suites.add_parser("scaling", help="one recipe at several world sizes: tokens/s, "
                                "speedup, efficiency, exposed communication; vs torch")
    scaling.add_argument("--nproc", default="1,2,4", help="world sizes, comma-separated")
    scaling.add_argument("--weak", action="store_true",
                         help="fixed rows per rank (the batch grows); default: fixed global batch")
    scaling.add_argument("--config", help="a TOML file, or the name of a recipe in configs/")
    scaling.add_argument("--steps", type=int, default=5, help="timed steps per world size")
    scaling.add_argument("--png", default="runs/bench_scaling/speedup.png",
                         help="speedup picture")
    scaling.add_argument("overrides", nargs="*", metavar="section.key=value")
    scaling.set_defaults(func=cmd_bench_scaling)
    ck = suites.add_parser("checkpoint", help="save and load time and bytes per rank, sync and "
                           "async, for the default and the 3-D recipe")
    ck.add_argument("--repeats", type=int, default=3, help="saves and loads per variant")
    ck.add_argument("overrides", nargs="*", metavar="section.key=value")
    ck.set_defaults(func=cmd_bench_checkpoint)
    moe = suites.add_parser("moe", help="a mixture of experts at several ep degrees on the same "
                            "ranks: step time, all-to-all share; vs looping over the experts")
    moe.add_argument("--nproc", type=int, default=4)
    moe.add_argument("--config", default="moe", help="a TOML file, or a recipe in configs/")
    moe.add_argument("--ep", default="1,2,4", help="expert-parallel degrees, comma-separated")
    moe.add_argument("--steps", type=int, default=5, help="timed steps per degree")
    moe.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    moe.add_argument("--png", default="runs/bench_moe/load.png", help="expert load histogram")
    moe.add_argument("overrides", nargs="*", metavar="section.key=value")
    moe.set_defaults(func=cmd_bench_moe)
    cp = suites.add_parser("cp", help="one long sequence: cp = 1 against ring attention and "
                           "Ulysses at each cp degree")
    cp.add_argument("--config", default="long_context",
                    help="a TOML file, or a recipe in configs/")
    cp.add_argument("--cp", default="2,4", help="context-parallel degrees, comma-separated")
    cp.add_argument("--methods", default="ring,ulysses", help="ring, ulysses or both")
    cp.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    cp.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    cp.add_argument("overrides", nargs="*", metavar="section.key=value")
    cp.set_defaults(func=cmd_bench_cp)
    memory = suites.add_parser("memory", help="each rank's peak host memory building a model and "
                               "through its first step, against the formulas")
    memory.add_argument("overrides", nargs="*", metavar="section.key=value")
    memory.set_defaults(func=cmd_bench_memory)
    data = suites.add_parser("data", help="plait data prepare's tokens/s per worker; training's "
                             "memory per rank and data wait on a small and a big corpus")
    data.add_argument("--nproc", type=int, default=2)
    data.add_argument("--sizes-mb", default="10,1024",
                      help="MiB of text to tokenize, then MiB of ids of each bigger corpus")
    data.add_argument("--workers", default="1,2", help="tokenizing processes, comma-separated")
    data.add_argument("--steps", type=int, default=20, help="timed steps per corpus")
    data.add_argument("--dir", default="runs/bench_data", help="where the corpora are written "
                      "(and deleted after)")
    data.add_argument("overrides", nargs="*", metavar="section.key=value")
    data.set_defaults(func=cmd_bench_data)
    plan = suites.add_parser("plan", help="the planner's predictions against runs here (bytes, "
                             "state, activations, step time) and published GPU runs")
    plan.add_argument("--which", default="all", help="measured, published or all")
    plan.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    plan.set_defaults(func=cmd_bench_plan)
    topo = suites.add_parser("topology", help="2 emulated nodes x 2 (root): tp, dp, HSDP and pp "
                             "inside vs across nodes at two link rates, predicted vs measured")
    topo.add_argument("--steps", type=int, default=8, help="timed steps per layout and rate")
    topo.add_argument("--ratios", default="18,75",
                      help="loopback's bandwidth over the inter-node link's, comma-separated")
    topo.add_argument("--json", action="store_true", help="print the rows as JSON instead")
    topo.add_argument("--out", default="runs/bench_topology/topology.json",
                      help="where the links' samples and fits and the rows are written")
    topo.set_defaults(func=cmd_bench_topology)


def cmd_bench_comm(args: argparse.Namespace) -> None:
    if args.nproc < 2:
        raise ConfigError("--nproc", f"a collective needs at least 2 ranks, got {args.nproc}")
    from plait.bench import run_comm

    run_comm(args.nproc, args.min_seconds)


def cmd_bench_step(args: argparse.Namespace) -> None:
    if args.nproc < 1:
        raise ConfigError("--nproc", f"need at least one process, got {args.nproc}")
    if args.steps < 1:
        raise ConfigError("--steps", f"need at least one timed step, got {args.steps}")
    from plait.bench import run_step

    run_step(args.nproc, load(args), args.steps)


def cmd_bench_pp(args: argparse.Namespace) -> None:
    if args.nproc < 2:
        raise ConfigError("--nproc", f"a pipeline needs at least 2 stages, got {args.nproc}")
    if args.steps < 1:
        raise ConfigError("--steps", f"need at least one timed step, got {args.steps}")
    from plait.bench import run_pp

    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    run_pp(args.nproc, load(args), args.steps, args.png)


def cmd_bench_compression(args: argparse.Namespace) -> None:
    if args.nproc < 2:
        raise ConfigError("--nproc", f"compression needs data parallelism: >= 2, got {args.nproc}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ConfigError("--methods", f"comma-separated names from {', '.join(METHODS)}; "
                          f"got {args.methods!r}")
    from plait.bench import run_compression

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
    from plait.bench import run_memory

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
    if args.steps < 2:
        raise ConfigError("--steps", f"at least 2 (the first is warm-up), got {args.steps}")
    cfg = load_config(None, [*DATA_MODEL, *args.overrides])
    from plait.bench.data import run_data

    run_data(cfg, args.nproc, sizes, workers, args.steps, Path(args.dir))


def cmd_bench_checkpoint(args: argparse.Namespace) -> None:
    if args.repeats < 1:
        raise ConfigError("--repeats", f"at least 1, got {args.repeats}")
    recipes = []
    for name, nproc in (("default", 4), ("3d", 8)):
        cfg = load_config(recipe_path(name), args.overrides)
        recipes.append((name, cfg, nproc))
    from plait.bench import run_checkpoint

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
    from plait.bench import run_scaling

    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    run_scaling(sizes, load(args), args.steps, args.weak, args.png)


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
    from plait.bench import run_moe

    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    run_moe(args.nproc, load(args), degrees, args.steps, args.warmup, args.png)


def cmd_bench_cp(args: argparse.Namespace) -> None:
    from plait.parallel.context_parallel import METHODS as CP_METHODS

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
    from plait.bench import run_cp

    run_cp(load(args), degrees, methods, args.steps, args.warmup)


def cmd_bench_plan(args: argparse.Namespace) -> None:
    if args.which not in ("all", "measured", "published"):
        raise ConfigError("--which", f"measured, published or all; got {args.which!r}")
    if args.steps < 1:
        raise ConfigError("--steps", f"at least 1 timed step, got {args.steps}")
    from plait.bench.plan import run_plan_bench

    run_plan_bench(args.steps, args.which)


def cmd_bench_topology(args: argparse.Namespace) -> None:
    import json

    from plait.nodes import available

    ratios = _counts(args.ratios, "--ratios")
    if args.steps < 1:
        raise ConfigError("--steps", f"at least 1 timed step, got {args.steps}")
    check_output_path(args.out, "--out")
    why = available()
    if why:
        raise ConfigError("bench topology", f"emulated nodes cannot be made here: {why}")
    from plait.bench.topology import run_topology

    found = run_topology(args.steps, ratios, quiet=args.json, out=args.out)
    if args.json:
        print(json.dumps(found["rows"], indent=1))
