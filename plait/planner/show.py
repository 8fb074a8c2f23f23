"""What `plait plan` prints and writes: the table of the best plans with the reasons for the first
and every plan's warnings, the JSON list (DESIGN's contract), a recipe `plait train` runs. Which
plans it shows is the policy's (`policy.py`)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from plait.config.schema import Config
from plait.planner.hardware import Cluster
from plait.planner.price import PricedLayout
from plait.planner.search import reasons


def layout_text(p: PricedLayout) -> str:
    """A layout in words, as the refusal's smallest change names it."""
    d = p.degrees
    return (f"tp {d['tp']}, pp {d['pp']}, cp {d['cp']}, ep {d['ep']}, dp {d['dp']}, "
            f"ZeRO-{d['zero']}, "
            + (f"{d['offload']} offload, " if d["offload"] != "none" else "")
            + f"{d['activation_checkpointing']} checkpointing")


def schedule(d: dict) -> str:
    """A plan's pipeline schedule as the table shows it: its virtual stages with interleaving."""
    if d["pp"] == 1:
        return "-"
    return f"{d['pp_schedule']} x{d['pp_virtual']}" if d["pp_virtual"] > 1 else d["pp_schedule"]


def print_plans(plans: list[PricedLayout], cluster: Cluster, top: int, params: int) -> None:
    console = Console(width=170)
    table = Table(title=f"plait plan: {params / 1e9:.2f}B parameters on {cluster.gpus} x "
                        f"{cluster.device.name}, {cluster.gpus_per_node} per node; best first")
    for col in ("#", "tp", "pp", "cp", "ep", "dp", "zero", "shard", "offload", "M", "schedule",
                "ckpt", "sp", "GB/GPU", "start GB", "step (s)", "tokens/s", "MFU", "bubble",
                "warnings"):
        table.add_column(col, justify="right")
    for i, p in enumerate(plans[:top], 1):
        d = p.degrees
        cp = f"{d['cp']} {d['cp_method']}" if d["cp"] > 1 else "1"
        table.add_row(str(i), str(d["tp"]), str(d["pp"]), cp, str(d["ep"]), str(d["dp"]),
                      str(d["zero"]),
                      str(d["dp_shard"] or "-"), "-" if d["offload"] == "none" else d["offload"],
                      str(d["microbatches"]),
                      schedule(d), d["activation_checkpointing"],
                      "yes" if d["sequence_parallel"] else "-",
                      f"{p.peak_memory_bytes / 1e9:.1f}", f"{p.startup_bytes / 1e9:.1f}",
                      f"{p.step_time_s:.3f}",
                      f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}", f"{p.bubble:.1%}",
                      str(len(p.warnings)))
    console.print(table)
    console.print("[bold]why #1:[/] " + "; ".join(reasons(plans[0], cluster)))
    if plans[0].fits and plans[0].degrees["offload"] != "none" and \
            not any(p.fits and p.degrees["offload"] == "none" for p in plans):
        console.print(f"[bold]only with offload:[/] no layout fits on {cluster.gpus} x "
                      f"{cluster.device.name} without it", highlight=False)
    for i, p in enumerate(plans[:top], 1):
        for w in p.warnings:
            console.print(f"[yellow]#{i}:[/] {w}", highlight=False)


def as_json(plans: list[PricedLayout], top: int) -> str:
    return json.dumps([p.as_json() for p in plans[:top]], indent=1)


def write_recipe(path: str, cfg: Config, plan: PricedLayout, cluster: Cluster) -> None:
    """A TOML recipe with the plan's degrees (dp left to the world size)."""
    d = plan.degrees
    sections = {
        "model": {"preset": cfg.model.preset, **cfg.model.overrides},
        "parallel": {k: d[k] for k in ("tp", "pp", "cp", "ep", "zero", "dp_shard",
                                       "microbatches", "pp_schedule", "pp_virtual",
                                       "sequence_parallel", "cp_method", "offload")},
        "train": {"global_batch": cfg.train.global_batch, "precision": cfg.train.precision,
                  "activation_checkpointing": d["activation_checkpointing"]},
        "data": {"seq_len": cfg.data.seq_len},
    }
    lines = [f"# plait plan for {cluster.gpus} x {cluster.device.name}: "
             + "; ".join(reasons(plan, cluster)),
             f"# run: plait train --config {path} --nproc {cluster.gpus} (or under torchrun)"]
    for name, values in sections.items():
        lines += ["", f"[{name}]", *(f"{k} = {json.dumps(v)}" for k, v in values.items())]
    Path(path).write_text("\n".join(lines) + "\n")
