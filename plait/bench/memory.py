"""`plait bench memory`: each rank's peak host memory while it builds its part of a model,
through its first training step, and through `STEPS` steps, against what the formulas say it
holds (`cost.startup_bytes`, `cost.state_bytes`' "peak" plus the step's activations) and against
the whole model in fp32, which every rank built before #30. Peak memory is the process's own
count (VmHWM), restarted after a tiny model's step so that the interpreter and everything the
trainer imports are the baseline.

Through the first step every block of 1 MiB or more has a mapping of its own, given back when
freed, so that peak is what was alive at once; from the second step on the heap serves them and
keeps what was freed for reuse (`plait/host_memory.py`): the later peak adds what it kept.
"""

from __future__ import annotations

import dataclasses
import gc

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.elastic.multiprocessing.errors import record

from plait.bench.step import start_worker
from plait.bench.text import size_text
from plait.config.schema import Config
from plait.host_memory import (
    peak_resident_bytes,
    reset_peak,
    resident_bytes,
)
from plait.launch import launch
from plait.model import count_params
from plait.model.llama import build_model
from plait.predict import cost
from plait.train.checks import validate
from plait.train.trainer import Trainer

STEPS = 3


@record
def bench_memory(cfg: Config, steps: int = STEPS) -> list[dict] | None:
    dims, mesh = start_worker(cfg)
    tiny = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, preset="tiny",
                                                              overrides={}))
    Trainer(tiny, dims, mesh, torch.device("cpu")).train_step(0)
    gc.collect()
    # Each phase starts together: a rank still building would otherwise receive its faster
    # peers' first all-gathers into gloo's buffers, counted in its own build (seen: +16 MiB on
    # one rank of a loaded machine).
    dist.barrier()
    reset_peak()
    baseline = resident_bytes()
    trainer = Trainer(cfg, dims, mesh, torch.device("cpu"))
    built = peak_resident_bytes() - baseline
    dist.barrier()
    result = trainer.train_step(0)
    stepped = peak_resident_bytes() - baseline
    for step in range(1, steps):
        trainer.train_step(step)
    record_ = trainer.parallelized.record
    state = trainer.parallelized.state_bytes(trainer.optimizer)
    row = {"rank": dist.get_rank(), "baseline": baseline, "built": built, "stepped": stepped,
           "steady": peak_resident_bytes() - baseline, "steps": steps,
           "startup_formula": cost.startup_bytes(cfg, dims, record_),
           "step_formula": state["peak"] + result["activation_bytes"],
           "held": sum(v for k, v in state.items() if k != "peak"),
           "whole_fp32": 4 * count_params(build_model(cfg.model.args(), 0, "meta"))}
    rows, rank = [None] * dist.get_world_size(), dist.get_rank()
    dist.all_gather_object(rows, row)
    dist.destroy_process_group()
    return rows if rank == 0 else None


def run_memory(layouts: list[tuple[str, Config, int]]) -> list[dict]:
    """Each (name, config, world size)'s per-rank peak host memory (`bench_memory` above)."""

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
        f"{first['whole_fp32'] / 4 / 1e6:,.0f}M parameters ({size_text(first['whole_fp32'])} in "
        "fp32, what every rank built before #30); peak resident memory over the baseline, "
        "the rank that grew most"))
    for col in ("layout", "ranks", "baseline", "building", "formula", "through step 1",
                "formula", f"through step {first['steps']}", "held after the steps",
                "peak / whole fp32"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in out:
        table.add_row(r["layout"], str(r["ranks"]), size_text(r["baseline"]), size_text(r["built"]),
                      size_text(r["startup_formula"]), size_text(r["stepped"]),
                      size_text(r["step_formula"]), size_text(r["steady"]), size_text(r["held"]),
                      f"{r['steady'] / r['whole_fp32']:.2f}")
    Console(width=150).print(table)
    return out
