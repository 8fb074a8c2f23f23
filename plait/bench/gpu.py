"""`plait bench gpu [--shape 1b|tiny]`: one device, plait's training step against the loop a user
would write instead, each side in a process of its own.

    plait           plait's trainer step (its Llama), blocks eager          train.compile=false
    plait-compiled  the same, each block's forward compiled                 train.compile=true
    plait-hf        plait training transformers' LlamaForCausalLM of that shape (model.hf),
                    compiled per block
    loop            thirty lines of torch over transformers' LlamaForCausalLM: autocast, cross-
                    entropy on the logits, backward, clip, fused AdamW
    loop-compiled   the same loop over `torch.compile(model)`

The same shape, global batch, precision (`train.precision`'s autocast), optimizer settings and
batches for every side; the loop's parameters are fp32, plait's as `train.param_dtype` says (an
override: `train.param_dtype=bf16` holds them in bf16 with fp32 masters, FSDP2's mixed
precision, and the title says so). A side that runs out of device memory at one
micro-batch retries with twice as many (the loop as its user would, by hand), and says so.
Reported per side: the median step after warm-up and its spread (interquartile range / median),
tokens/s, MFU by plait's FLOP count of the model (`predict.trace.model_flops`, the same numerator
for every side) over the device's peak, the peak memory (the device's count of allocated and
reserved bytes on a GPU; the process's peak resident set, /proc's VmHWM, on the CPU), the first
step's seconds (compilation included), and the ratios plait / loop that matter: compiled plait
against the compiled loop, and plait over transformers' module against the compiled loop over it.

At `--shape tiny` it runs on the CPU too (the suite runs it so, with `--compile-backend
aot_eager`, which compiles without generating code).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.distributed.elastic.multiprocessing.errors import record

from plait import forkserver
from plait.bench.step import summarize
from plait.config.choices import held_precision
from plait.config.schema import Config, ModelConfig, load_config
from plait.data.batches import TokenData
from plait.launch import launch
from plait.mesh import build_mesh
from plait.optim.loss_scaling import HALF
from plait.parallel.compile import compiled_graphs, graph_breaks
from plait.predict.trace import model_flops
from plait.train.checks import validate
from plait.train.metrics import peak_flops
from plait.train.run import worker_device
from plait.train.trainer import Trainer

SIDES = ("plait", "plait-compiled", "plait-hf", "loop", "loop-compiled")
SHAPES = {  # the model and batch of each shape
    "1b": ["model.preset='1b'", "data.seq_len=2048", "train.global_batch=8",
           "train.precision=bf16", "data.max_bytes=4000000"],
    "tiny": ["model.preset='tiny'", "data.seq_len=32", "train.global_batch=8",
             "data.max_bytes=200000"],
}


def shape_config(shape: str, overrides: list[str] = ()) -> Config:
    return load_config(None, [*SHAPES[shape], "train.eval_batches=1", *overrides])


def _peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"allocated": torch.cuda.max_memory_allocated(device),
                "reserved": torch.cuda.max_memory_reserved(device)}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return {"allocated": int(line.split()[1]) * 1024, "reserved": None}
    return {"allocated": None, "reserved": None}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plait_step(cfg: Config, device: torch.device, hf_dir: str | None):
    """plait's side: the trainer's own step (its one step path)."""

    if hf_dir is not None:

        cfg = dataclasses.replace(cfg, model=ModelConfig(hf=hf_dir))
    dims = validate(cfg, dist.get_world_size())
    trainer = Trainer(cfg, dims, build_mesh(dims, device.type), device)
    steps = iter(range(10**9))
    return lambda: trainer.train_step(next(steps))


def _loop_step(cfg: Config, device: torch.device, compiled: bool, microbatches: int):
    """The loop a user writes over transformers' Llama of the run's shape."""
    # here, not at the top: transformers only for a Hugging Face model
    from transformers import LlamaConfig, LlamaForCausalLM

    # here, not at the top: safetensors only for a Hugging Face folder
    from plait.checkpoint.hf import hf_config

    train = cfg.train
    torch.manual_seed(train.seed)
    keys = {k: v for k, v in hf_config(cfg.model.args()).items() if k != "torch_dtype"}
    model = LlamaForCausalLM(LlamaConfig(**keys, attn_implementation="sdpa")).to(device)
    if compiled:
        model = torch.compile(model, backend=train.compile_backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=(train.beta1, train.beta2),
                                  weight_decay=train.weight_decay,
                                  fused=device.type == "cuda")
    data, half = TokenData(cfg.data, train.seed), HALF.get(train.precision)
    steps = iter(range(10**9))

    def step():
        x, y = data.batch(next(steps), train.global_batch)
        for mx, my in zip(x.to(device).chunk(microbatches), y.to(device).chunk(microbatches),
                          strict=True):
            with torch.autocast(device.type, dtype=half or torch.float32,
                                enabled=half is not None):
                logits = model(input_ids=mx).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), my.flatten()) / microbatches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _build(side: str, cfg: Config, device: torch.device, microbatches: int, hf_dir: str):
    compiled = side.endswith("compiled") or side == "plait-hf"
    if side.startswith("plait"):
        par = dataclasses.replace(cfg.parallel, microbatches=microbatches)
        train = dataclasses.replace(cfg.train, compile=compiled)
        return _plait_step(dataclasses.replace(cfg, parallel=par, train=train), device,
                           hf_dir if side == "plait-hf" else None)
    return _loop_step(cfg, device, compiled, microbatches)


@record
def bench_side(cfg: Config, side: str, warmup: int, steps: int, hf_dir: str) -> dict | None:
    """One side in this process: its step times after `warmup` steps, its first step's, its peak
    memory over the timed steps, the micro-batches it needed."""

    torch.set_num_threads(cfg.train.threads)
    device = worker_device(cfg.train.device)
    # One rank: every collective of plait's is a no-op.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    microbatches, notes = 1, []
    while True:
        try:
            step = _build(side, cfg, device, microbatches, hf_dir)
            start = time.perf_counter()
            step()
            _sync(device)
            first = time.perf_counter() - start
            step()  # the optimizer's state exists from the first step's end: memory's high mark
            _sync(device)
            break
        except torch.OutOfMemoryError:
            step = None
            gc.collect()  # the failed attempt's model and optimizer state
            if microbatches >= cfg.train.global_batch:
                raise
            torch.cuda.empty_cache()
            microbatches *= 2
            notes.append(f"out of memory: {microbatches} micro-batches")
    for _ in range(max(warmup - 2, 0)):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()

    breaks, first_break = graph_breaks()
    if breaks:
        notes.append(f"{breaks} graph break(s), first: {first_break}")
    if side != "plait" and side != "loop":
        notes.append(f"{compiled_graphs()} graph(s) compiled")
    return {"times": times, "first_s": first, "memory": _peak_memory(device),
            "microbatches": microbatches, "notes": notes, "device": _device_name(device)}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"CPU ({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}"


def run_gpu(cfg: Config, warmup: int, steps: int, sides: tuple[str, ...] = SIDES,
            json_out: str | None = None) -> dict:
    """Every side in a process of its own, one after the other; prints the table, returns rows."""
    # here, not at the top: safetensors only for a Hugging Face folder
    from plait.checkpoint.hf import hf_config

    flops = model_flops(cfg)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    rows = {}
    with tempfile.TemporaryDirectory(prefix="plait-bench-gpu-") as hf_dir:
        # transformers' module of the run's shape, as a folder with no weights (a fresh init).
        Path(hf_dir, "config.json").write_text(json.dumps(hf_config(cfg.model.args())))
        for side in sides:
            got = launch(1, bench_side, cfg, side, warmup, steps, hf_dir,
                         threads=cfg.train.threads, preload=forkserver.HF)[0]
            rows[side] = got
            print(f"plait bench gpu: {side}: median step {statistics.median(got['times']):.4f} s, "
                  f"first {got['first_s']:.1f} s, memory {got['memory']}, micro-batches "
                  f"{got['microbatches']}; {'; '.join(got['notes'])}", flush=True)
    device = next(iter(rows.values()))["device"]
    peak = peak_flops(torch.device("cuda" if "CPU" not in device else "cpu"),
                      cfg.train.peak_tflops)

    timed = summarize({side: got["times"] for side, got in rows.items()})
    out = {}
    for side, got in rows.items():
        median = timed[side]
        out[side] = {"step_s": median, "spread": timed[f"{side}_spread"],
                     "tokens_per_s": tokens / median, "mfu": flops / median / peak,
                     "first_step_s": got["first_s"], "memory": got["memory"],
                     "microbatches": got["microbatches"], "notes": got["notes"]}
    ratios = {}
    for name, (a, b) in {"plait-compiled / loop-compiled": ("plait-compiled", "loop-compiled"),
                         "plait-hf / loop-compiled": ("plait-hf", "loop-compiled"),
                         "plait / loop": ("plait", "loop")}.items():
        if a in out and b in out:
            ratios[name] = out[a]["step_s"] / out[b]["step_s"]
    _print(out, ratios, device, cfg)
    result = {"device": device, "shape": _shape_of(cfg), "sides": out, "ratios": ratios}
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=1))
    return result


def _shape_of(cfg: Config) -> str:
    a, train = cfg.model.args(), cfg.train
    held = held_precision(train.precision, train.param_dtype, cfg.parallel.zero)
    return (f"dim {a.dim}, {a.n_layers} layers, {a.n_heads} heads / {a.n_kv_heads} kv, ffn "
            f"{a.ffn_dim}, vocabulary {a.vocab_size}; {train.global_batch} x "
            f"{cfg.data.seq_len} tokens a step, {train.precision}"
            + (f" (plait's parameters {held}, fp32 masters)" if held != "fp32" else ""))


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:,.2f}"


def _print(out: dict, ratios: dict, device: str, cfg: Config) -> None:
    table = Table(title=f"plait bench gpu: {device}; {_shape_of(cfg)}")
    for col in ("side", "step (s)", "spread", "tokens/s", "MFU", "peak alloc (GiB)",
                "peak reserved (GiB)", "first step (s)", "micro-batches"):
        table.add_column(col, justify="left" if col == "side" else "right")
    for side, r in out.items():
        table.add_row(side, f"{r['step_s']:.4f}", f"{r['spread']:.1%}",
                      f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.1%}",
                      _gib(r["memory"]["allocated"]), _gib(r["memory"]["reserved"]),
                      f"{r['first_step_s']:.1f}", str(r["microbatches"]))
    console = Console(width=160)
    console.print(table)
    for name, ratio in ratios.items():
        verdict = "shorter" if ratio < 1 else "longer" if ratio > 1 else "as long"
        console.print(f"{name}: {ratio:.3f} (plait's step is {verdict})")
    for side, r in out.items():
        for note in r["notes"]:
            console.print(f"{side}: {note}")
