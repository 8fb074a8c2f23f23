"""`plait bench plan`: the planner's predictions against real runs on this machine, and against
published runs on GPU clusters.

Measured (`ROWS`, every strategy and composition, each its own job of CPU ranks): rank 0's
model-state bytes, bytes communicated in a step and peak activation bytes, which the plan must
equal (activations: within 5%; expert parallelism's token all-to-alls are balanced by
expert-choice routing at capacity factor 1, which is what a plan expects); and the step time
(median after two warm-up steps, the slowest rank's) against the plan's on the device that
`plait plan --calibrate` measured.

Published: `plait.bench.published` (Megatron-LM, Llama 3, torchtitan), each run's layout pinned,
its throughput and memory against the plan's.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.elastic.multiprocessing.errors import record

from plait.bench.published import print_published, published_rows
from plait.bench.step import start_worker
from plait.comm import LEDGER
from plait.config.schema import load_config
from plait.launch import launch
from plait.planner.calibrate import load
from plait.planner.hardware import Cluster, cpu_device
from plait.planner.price import estimate
from plait.train.checks import validate
from plait.train.progress import each
from plait.train.trainer import Trainer

BASE = ["model.preset='small'", "train.global_batch=8", "data.seq_len=128"]
MOE = ["model.preset='small-moe'", "model.moe_router='expert_choice'",
       "model.moe_capacity_factor=1.0"]
PP = ["parallel.microbatches=4"]

# (name, ranks, overrides on BASE)
ROWS = [
    ("one rank", 1, []),
    ("DDP dp2", 2, []),
    ("DDP dp4", 4, []),
    ("DDP dp2, accumulation 2", 2, ["parallel.microbatches=2"]),
    ("ZeRO-1 dp2", 2, ["parallel.zero=1"]),
    ("ZeRO-2 dp4", 4, ["parallel.zero=2"]),
    ("ZeRO-3 dp4", 4, ["parallel.zero=3"]),
    ("HSDP ZeRO-3 dp4 shard 2", 4, ["parallel.zero=3", "parallel.dp_shard=2"]),
    ("ZeRO-1 dp2 bf16", 2, ["parallel.zero=1", "train.precision='bf16'"]),
    ("DDP dp2 fp16-compressed", 2, ["parallel.compression='fp16'"]),
    ("tp2", 2, ["parallel.tp=2"]),
    ("tp2 + sp", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("tp2 dp2 ZeRO-1", 4, ["parallel.tp=2", "parallel.zero=1"]),
    ("pp2 GPipe", 2, ["parallel.pp=2", "parallel.pp_schedule='gpipe'", *PP]),
    ("pp2 1F1B", 2, ["parallel.pp=2", *PP]),
    ("pp2 interleaved", 2, ["parallel.pp=2", "parallel.pp_schedule='interleaved'", *PP]),
    ("pp2 zero-bubble", 2, ["parallel.pp=2", "parallel.pp_schedule='zb1'", *PP]),
    ("pp4 1F1B", 4, ["parallel.pp=4", *PP]),
    ("3D pp2 tp2 dp2 ZeRO-1", 8, ["parallel.pp=2", "parallel.tp=2", "parallel.zero=1", *PP]),
    ("cp2 ring", 2, ["parallel.cp=2"]),
    ("cp2 Ulysses", 2, ["parallel.cp=2", "parallel.cp_method='ulysses'"]),
    ("cp2 tp2 ZeRO-3", 4, ["parallel.cp=2", "parallel.tp=2", "parallel.zero=3"]),
    ("ep2 (MoE)", 2, [*MOE, "parallel.ep=2"]),
    ("ep2 dp2 ZeRO-1 (MoE)", 4, [*MOE, "parallel.ep=2", "parallel.zero=1"]),
    ("DDP dp2, full checkpointing", 2, ["train.activation_checkpointing='full'"]),
    ("tp2, selective checkpointing", 2, ["parallel.tp=2",
                                         "train.activation_checkpointing='selective'"]),
]


@record
def measure_run(cfg, steps: int) -> dict | None:
    """On every rank: `steps` training steps after two warm-ups; rank 0 returns its last step's
    bytes and the median step time of the slowest rank."""

    dims, mesh = start_worker(cfg)
    trainer = Trainer(cfg, dims, mesh, torch.device("cpu"))
    times = []
    for step in range(steps + 2):
        LEDGER.reset()
        dist.barrier()
        start = time.perf_counter()
        result = trainer.train_step(step)
        times.append(time.perf_counter() - start)
    ledger = LEDGER.snapshot()
    slowest = torch.tensor(times[2:])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    state = trainer.parallelized.state_bytes(trainer.optimizer)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank:
        return None
    held = sum(v for k, v in state.items() if k != "peak")  # "peak": during the step
    return {"state": held, "comm": ledger["bytes"],
            "activations": result["activation_bytes"],
            "step_s": statistics.median(slowest.tolist())}


def predicted(cfg, ranks: int, device) -> dict:
    """The plan's numbers for rank 0 of cfg on `ranks` ranks of one machine."""

    plan = estimate(cfg, validate(cfg, ranks), Cluster(ranks, ranks, device))
    memory = plan.memory_bytes
    return {"state": memory["total"] - memory["activations"], "comm": plan.comm_bytes,
            "activations": memory["activations"], "step_s": plan.step_time_s}


def relative(pred: float, meas: float) -> float:
    return pred / meas - 1 if meas else (0.0 if pred == meas else float("inf"))


def measured_rows(steps: int) -> list[dict]:
    """Each row of ROWS run (its own job) and planned on the calibrated CPU device."""

    configs = [(name, n, load_config(None, [*BASE, *overrides])) for name, n, overrides in ROWS]
    for _, n, cfg in configs:
        validate(cfg, n)  # every row checked before any worker starts
    rows = []
    for name, n, cfg in each(configs, "bench plan: configurations", label=lambda c: c[0]):
        measured = launch(n, measure_run, cfg, steps)[0]
        rows.append({"name": name, "ranks": n, "measured": measured,
                     "predicted": predicted(cfg, n, cpu_device(n))})
    return rows


def _pct(x: float) -> str:
    return f"{x:+.1%}" if x == x else "-"


def print_measured(rows: list[dict], device_name: str) -> None:
    table = Table(title=f"plait bench plan: predicted vs measured on this machine, rank 0 "
                        f"('small' preset, 8 x 128 tokens; step time on {device_name})")
    for col in ("configuration", "ranks", "state MiB", "state", "comm MiB", "comm",
                "activations MiB", "activations", "step ms (pred / meas)", "step time"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    errors = {k: [] for k in ("state", "comm", "activations", "step_s")}
    for r in rows:
        p, m = r["predicted"], r["measured"]
        err = {k: relative(p[k], m[k]) for k in errors}
        for k, e in err.items():
            errors[k].append(abs(e))
        table.add_row(r["name"], str(r["ranks"]), f"{m['state'] / 2**20:,.2f}",
                      "equal" if p["state"] == m["state"] else _pct(err["state"]),
                      f"{m['comm'] / 2**20:,.2f}",
                      "equal" if p["comm"] == m["comm"] else _pct(err["comm"]),
                      f"{m['activations'] / 2**20:,.2f}",
                      "equal" if p["activations"] == m["activations"]
                      else _pct(err["activations"]),
                      f"{p['step_s'] * 1e3:,.0f} / {m['step_s'] * 1e3:,.0f}",
                      _pct(err["step_s"]))
    for label, pick in (("mean |error|", statistics.mean), ("worst |error|", max)):
        table.add_row(label, "", "", f"{pick(errors['state']):.1%}", "",
                      f"{pick(errors['comm']):.1%}", "", f"{pick(errors['activations']):.1%}",
                      "", f"{pick(errors['step_s']):.1%}", style="bold")
    Console(width=170).print(table)


def run_plan_bench(steps: int, which: str) -> dict:
    """`plait bench plan`: the measured table (needs `plait plan --calibrate` first for step
    times in this machine's seconds), the published table, or both."""

    out = {}
    if which in ("all", "measured"):
        out["measured"] = measured_rows(steps)
        calibrated = "calibrated" if load() else "NOT calibrated: run plait plan --calibrate"
        print_measured(out["measured"], f"the cpu device, {calibrated}")
    if which in ("all", "published"):

        out["published"] = published_rows()
        print_published(out["published"])
    return out
