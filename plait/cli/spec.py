"""The command line as data: each command's help, options and handler. A handler is named
("module:function") and imported only when its command runs, so that parsing, and refusing a bad
key or value, imports no torch (`__init__.py`, `main`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from plait.planner.hardware import DEVICES, ENGINES  # plain data: no torch


def arg(*flags: str, **options) -> tuple[tuple[str, ...], dict]:
    """One `add_argument` call, as data."""
    return flags, options


CONFIG = arg("--config", help="a TOML file, or the name of a recipe in configs/")
OVERRIDES = arg("overrides", nargs="*", metavar="section.key=value")


def nproc(default: int | None, what: str = "local workers") -> tuple:
    return arg("--nproc", type=int, default=default, help=what)


def steps(default: int, what: str) -> tuple:
    return arg("--steps", type=int, default=default, help=f"timed steps per {what}")


def png(default: str, what: str) -> tuple:
    return arg("--png", default=default, help=what)


@dataclass(frozen=True)
class Command:
    """A command (`handler`, its `args`; `exclusive`: a required group of which one is given),
    or a command of commands (`commands`, chosen into `dest`)."""

    name: str
    help: str
    handler: str = ""
    args: tuple = ()
    exclusive: tuple = ()
    commands: tuple = ()
    dest: str = ""


TRAIN = Command("train", "train a model on N local workers, or under torchrun",
                "plait.cli.commands:cmd_train", (
    CONFIG,
    arg("--nproc", type=int, help="local workers (default: the config's degrees)"),
    arg("--metrics", help="write one JSON object per step here (rank 0)"),
    arg("--tensorboard", metavar="DIR",
        help="also write every metric as a TensorBoard scalar here (rank 0)"),
    arg("--trace", metavar="DIR", help="write a Chrome/Perfetto trace of each rank's steps here "
        "(and the pipeline timeline with pp > 1)"),
    arg("--trace-steps", type=int, default=1, metavar="N",
        help="how many steps to trace, from the second (default 1)"),
    arg("--max-restarts", type=int, default=0, metavar="N",
        help="restart the workers up to N times when one fails, resuming from the newest "
        "checkpoint in checkpoint.dir (torchrun: its own flag)"),
    arg("--nnodes", metavar="N|MIN:MAX", help="nodes of a multi-node job: this node's part is "
        "torchrun's, with a c10d rendezvous at --rdzv-endpoint"),
    arg("--rdzv-endpoint", metavar="HOST:PORT",
        help="the multi-node job's rendezvous, on one of its nodes"),
    arg("--local-addr", metavar="ADDRESS",
        help="this node's address for the others (torchrun's; where nodes share a host name)"),
    arg("--verify", action="store_true", help="one step of this layout against one process from "
        "the same weights and batch: the largest gradient differences per parameter group; exit "
        "1 beyond tolerance"),
    arg("--dry-run", action="store_true",
        help="print what each rank would hold and communicate; start nothing"),
    OVERRIDES))

RUN = Command("run", "run your own script on N local workers, as torchrun would (it calls "
              "plait.init(); docs/python.md)", "plait.cli.commands:cmd_run", (
    nproc(1, "local workers (default 1)"),
    arg("--threads", type=int, default=1, help="intra-op threads per worker"),
    arg("--preload", action="append", default=[], metavar="MODULE",
        help="a module the script imports (transformers, ...), imported once before the workers "
        "are forked instead of by each (repeatable)"),
    arg("script", help="a Python file"),
    arg("args", nargs=argparse.REMAINDER, help="the script's own arguments")))

BENCH = Command("bench", "benchmarks against the PyTorch-native peers", dest="suite", commands=(
    Command("comm", "bandwidth of each collective and all-reduce algorithm",
            "plait.cli.bench:cmd_bench_comm", (
                nproc(4), arg("--min-seconds", type=float, default=0.2,
                              help="time per size and collective"))),
    Command("step", "plait's step against PyTorch's own: DDP, ZeRO, TP, 3-D",
            "plait.cli.bench:cmd_bench_step", (
                nproc(4), CONFIG, steps(10, "variant and launch"),
                arg("--repeats", type=int, default=2,
                    help="launches of each side, by turns (each its own processes)"),
                OVERRIDES)),
    Command("gpu", "one device: plait's step (eager, compiled, on transformers' module) against "
            "the plain torch loop over transformers' Llama (eager, compiled)",
            "plait.cli.bench:cmd_bench_gpu", (
                arg("--shape", choices=("1b", "tiny"), default="1b",
                    help="plait's 1b preset at 8 x 2,048 tokens in bf16 (a GPU), or tiny"),
                steps(10, "side"), arg("--warmup", type=int, default=3,
                                       help="steps before the timed ones"),
                arg("--compile-backend", default="inductor",
                    help="torch.compile's backend for the compiled sides"),
                arg("--sides", default=",".join(("plait", "plait-compiled", "plait-hf", "loop",
                                                 "loop-compiled")),
                    help="comma-separated sides to run"),
                arg("--json", dest="json_out", help="also write the rows to this file"),
                OVERRIDES)),
    Command("pp", "pipeline schedules: bubbles, memory, vs torch pipelining",
            "plait.cli.bench:cmd_bench_pp", (
                nproc(2, "pipeline stages"), CONFIG, steps(5, "schedule"),
                png("runs/bench_pp/timeline.png", "timeline picture"), OVERRIDES)),
    Command("compression", "each gradient compression method on one recipe: loss, bytes, time; "
            "vs torch's DDP hooks", "plait.cli.bench:cmd_bench_compression", (
                nproc(4), CONFIG,
                arg("--methods", help="comma-separated, from fp16, bf16, int8, topk, powersgd, "
                    "sign (default: every method)"),
                png("runs/bench_compression/loss.png", "loss curves picture"), OVERRIDES)),
    Command("scaling", "one recipe at several world sizes: tokens/s, speedup, efficiency, exposed "
            "communication; vs torch", "plait.cli.bench:cmd_bench_scaling", (
                arg("--nproc", default="1,2,4", help="world sizes, comma-separated"),
                arg("--weak", action="store_true", help="fixed rows per rank (the batch grows); "
                    "default: fixed global batch"),
                CONFIG, steps(5, "world size"),
                png("runs/bench_scaling/speedup.png", "speedup picture"), OVERRIDES)),
    Command("checkpoint", "save and load time and bytes per rank, sync and async, for the "
            "default and the 3-D recipe", "plait.cli.bench:cmd_bench_checkpoint", (
                arg("--repeats", type=int, default=3, help="saves and loads per variant"),
                OVERRIDES)),
    Command("moe", "a mixture of experts at several ep degrees on the same ranks: step time, "
            "all-to-all share; vs looping over the experts", "plait.cli.bench:cmd_bench_moe", (
                nproc(4), arg("--config", default="moe", help="a TOML file, or a recipe in "
                              "configs/"),
                arg("--ep", default="1,2,4", help="expert-parallel degrees, comma-separated"),
                steps(5, "degree"),
                arg("--warmup", type=int, default=2, help="untimed steps first"),
                png("runs/bench_moe/load.png", "expert load histogram"), OVERRIDES)),
    Command("cp", "one long sequence: cp = 1 against ring attention and Ulysses at each cp "
            "degree", "plait.cli.bench:cmd_bench_cp", (
                arg("--config", default="long_context",
                    help="a TOML file, or a recipe in configs/"),
                arg("--cp", default="2,4", help="context-parallel degrees, comma-separated"),
                arg("--methods", default="ring,ulysses", help="ring, ulysses or both"),
                steps(3, "variant"),
                arg("--warmup", type=int, default=1, help="untimed steps first"), OVERRIDES)),
    Command("memory", "each rank's peak host memory building a model and through its first "
            "step, against the formulas", "plait.cli.bench:cmd_bench_memory", (OVERRIDES,)),
    Command("data", "plait data prepare's tokens/s per worker; training's memory per rank and "
            "data wait on a small and a big corpus", "plait.cli.bench:cmd_bench_data", (
                nproc(2),
                arg("--sizes-mb", default="10,1024",
                    help="MiB of text to tokenize, then MiB of ids of each bigger corpus"),
                arg("--workers", default="1,2", help="tokenizing processes, comma-separated"),
                steps(20, "corpus"),
                arg("--launch-gb", default="1,100",
                    help="GiB of each sparse corpus a launch is timed on"),
                arg("--dir", default="runs/bench_data",
                    help="where the corpora are written (and deleted after)"), OVERRIDES)),
    Command("gemm", "this machine's matrix-multiply rate by shape (bf16, fp8), beside the "
            "planner's shape model", "plait.cli.bench:cmd_bench_gemm", (
                arg("--out", default="runs/bench_gemm/gemm.json", help="the sweep as JSON"),
                arg("--fp8", action="store_true", help="also fp8 (torch._scaled_mm; GPUs with "
                    "fp8 tensor cores)"),
                steps(10, "shape, after three warm-up products"))),
    Command("plan", "the planner's predictions against runs here (bytes, state, activations, "
            "step time) and published GPU runs", "plait.cli.bench:cmd_bench_plan", (
                arg("--which", default="all", help="measured, published or all"),
                steps(3, "configuration"))),
    Command("topology", "2 emulated nodes x 2 (root): tp, dp, HSDP and pp inside vs across "
            "nodes at two link rates, predicted vs measured", "plait.cli.bench:cmd_bench_topology",
            (steps(8, "layout and rate"),
             arg("--ratios", default="18,75",
                 help="loopback's bandwidth over the inter-node link's, comma-separated"),
             arg("--json", action="store_true", help="print the rows as JSON instead"),
             arg("--out", default="runs/bench_topology/topology.json",
                 help="where the links' samples and fits and the rows are written")))))

DATA = Command("data", "prepare a corpus: tokenize text into memory-mapped shards",
               dest="data_command", commands=(
    Command("prepare", "tokenize text files, folders, JSONL / Parquet / Arrow tables into OUT",
            "plait.cli.data:cmd_data_prepare", (
                arg("paths", nargs="+", metavar="SRC... OUT",
                    help="text files or folders (a file is a document), JSONL / Parquet / Arrow "
                    "files (a row is a document); then the folder to write"),
                arg("--tokenizer", required=True, metavar="T",
                    help="a tokenizer.json, a Hugging Face model folder holding one, bpe:N "
                    "(train a byte-level BPE of N tokens on SRC) or bytes"),
                arg("--field", default="text", help="the text's field in table rows"),
                arg("--workers", type=int, default=1, help="tokenizing processes"),
                arg("--shard-tokens", type=int, metavar="N",
                    help="ids per shard file (default 268,435,456)"),
                arg("--follow-links", action="store_true",
                    help="read files that links in a source folder point to outside it"))),
    Command("verify", "read a prepared corpus whole: each shard's sha256 and every id",
            "plait.cli.data:cmd_data_verify", (
                arg("folder", metavar="OUT", help="a folder plait data prepare wrote"),
                arg("--sample", type=int, default=0, metavar="N",
                    help="N shards chosen at random (default: every shard)")))))

COMPARE = Command("compare", "two runs' losses step by step; exit 1 at the first step beyond "
                  "tolerance", "plait.cli.commands:cmd_compare", (
    arg("a", metavar="A.jsonl"), arg("b", metavar="B.jsonl"),
    arg("--rtol", type=float, default=1e-5, help="relative tolerance on each step's loss "
        "(default 1e-5: float32 reduction order)"),
    arg("--png", help="also draw both runs' train and validation losses into this PNG")))

PLAN = Command("plan", "choose the layout for a model on a cluster: memory, time, warnings; "
               "before any GPU-hour", "plait.cli.commands:cmd_plan", (
    CONFIG,
    arg("--gpus", type=int, help="devices in the job (required unless --calibrate)"),
    arg("--gpus-per-node", type=int, default=8),
    arg("--gpu", default="h100",
        help=f"{', '.join(DEVICES)}, or cpu (this machine)"),
    arg("--engine", default="plait", choices=list(ENGINES),
        help="the implementation priced: plait (default: plait as it runs now), megatron "
        "(fused kernels, half parameters, sequence parallelism, overlapped reductions), "
        "megatron-2021 (the same without sequence parallelism, reducing after the backward), "
        "deepspeed (eager, half parameters, ZeRO-3 gathering each module's own parameters, "
        "at most 1e9 at once), "
        "torchtitan (eager blocks, FlashAttention-2), "
        "plait-2026-11-26 (plait's eager step of that day)"),
    arg("--gpu-memory-gb", type=float,
        help="the device's memory in GB, for a device of another size"),
    arg("--gpu-tflops", type=float,
        help="the device's dense bf16 peak in TFLOP/s, for a variant of another rate"),
    arg("--intra-node-gbps", type=float, help="GB/s each way within a node"),
    arg("--inter-node-gbps", type=float, help="GB/s each way per GPU between nodes"),
    arg("--top", type=int, default=5, help="plans shown"),
    arg("--json", action="store_true", help="print the plans as a JSON list"),
    arg("--write-recipe", metavar="FILE", help="write the best plan as a recipe"),
    arg("--calibrate", action="store_true",
        help="measure this machine (matmul rate, gloo alpha-beta) for --gpu cpu"),
    OVERRIDES))

REPORT = Command("report", "PNGs of a run's metrics: loss, throughput, communication, memory",
                 "plait.cli.commands:cmd_report", (
    arg("metrics", metavar="METRICS",
        help="a metrics file (plait train --metrics), or the folder holding it"),
    arg("--out", help="folder for the PNGs (default: report/ beside the file)")))

CONVERT = Command("convert", "a checkpoint to a Hugging Face folder (--to hf OUT CKPT: a model.hf "
                  "run's as its own family's, plait's Llama as a Llama's), or a Hugging Face "
                  "Llama folder into a checkpoint of plait's Llama (--from hf HF_DIR OUT)",
                  "plait.cli.commands:cmd_convert", (
    arg("first", metavar="OUT|HF_DIR"), arg("second", metavar="CKPT|OUT_CKPT")), exclusive=(
    arg("--to", choices=["hf"], help="export CKPT (any layout) into the folder OUT"),
    arg("--from", dest="source", choices=["hf"],
        help="import the Hugging Face folder HF_DIR as the checkpoint OUT")))

COMMANDS = (TRAIN, RUN, BENCH, DATA, COMPARE, PLAN, REPORT, CONVERT)


def add_commands(sub, parser_class, commands: tuple[Command, ...]) -> None:
    for c in commands:
        parser = sub.add_parser(c.name, help=c.help)
        if c.commands:
            inner = parser.add_subparsers(dest=c.dest, required=True, parser_class=parser_class)
            add_commands(inner, parser_class, c.commands)
            continue
        if c.exclusive:
            group = parser.add_mutually_exclusive_group(required=True)
            for flags, options in c.exclusive:
                group.add_argument(*flags, **options)
        for flags, options in c.args:
            parser.add_argument(*flags, **options)
        parser.set_defaults(handler=c.handler)
