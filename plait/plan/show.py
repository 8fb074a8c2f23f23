"""What `plait plan` prints and writes: the table of the best plans with the reasons for the first
and every plan's warnings, the JSON list (DESIGN's contract), a recipe `plait train` runs."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from plait.config import Config, ConfigError
from plait.plan import HEADROOM, Plan, rank_plans, reasons
from plait.plan.hardware import Cluster

PINNABLE = {"parallel.tp": "tp", "parallel.pp": "pp", "parallel.cp": "cp", "parallel.ep": "ep",
            "parallel.cp_method": "cp_method", "parallel.zero": "zero",
            "parallel.dp_shard": "dp_shard", "parallel.microbatches": "microbatches",
            "parallel.pp_schedule": "pp_schedule",
            "parallel.sequence_parallel": "sequence_parallel", "parallel.offload": "offload",
            "train.activation_checkpointing": "activation_checkpointing"}


# A layout's degrees: pinned all, the layout is the user's, priced even when it does not fit.
DEGREES = {"tp", "pp", "cp", "ep", "zero"}


def pinned(cfg: Config, overrides: list[str]) -> dict:
    """The degrees the user's overrides fix (the others are searched)."""
    out = {}
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in PINNABLE:
            section, name = key.split(".")
            out[PINNABLE[key]] = getattr(getattr(cfg, section), name)
    return out


def choose(cfg: Config, cluster: Cluster, fixed: dict) -> list[Plan]:
    """The ranked plans. Refuses (status 2, one line) when none is valid, or when none fits
    and the degrees leave a choice, naming the cause and the smallest change that would fit;
    a layout whose degrees are all pinned (`DEGREES`) is returned even when it does not fit,
    the leanest of its variants (the caller prints it with its warning and exits 1)."""
    plans = rank_plans(cfg, cluster, fixed)
    model = cfg.model.hf or cfg.model.preset
    if not plans:
        pins = ", ".join(f"{k}={v}" for k, v in fixed.items()) or "none pinned"
        raise ConfigError("plan", f"no layout of model '{model}' is valid on {cluster.gpus} GPUs "
                          f"with these settings ({pins}); change --gpus or the pinned degrees")
    if plans[0].fits or len(plans) == 1:
        return plans
    if DEGREES <= fixed.keys():
        # Every degree pinned: the layout is the user's; of its variants (recomputation,
        # micro-batches, offload) the leanest is priced and shown, with "does not fit".
        return [min(plans, key=lambda p: p.peak_memory_bytes)]
    need = min(p.peak_memory_bytes for p in plans) / 1e9
    usable = HEADROOM * cluster.device.memory_bytes
    lean = min(plans, key=lambda p: _state_on_device(p))
    if _state_on_device(lean) > usable:  # the model state alone, before any activation
        cause = (f"its model state alone needs {_state_on_device(lean) / 1e9:.1f} GB per GPU "
                 f"at best (ZeRO-{lean.degrees['zero']}"
                 + (f", {lean.degrees['offload']} offload" if lean.degrees["offload"] != "none"
                    else "") + ")")
        change = "use more GPUs or GPUs with more memory"
    else:
        cause = f"the leanest layout needs {need:.1f} GB per GPU"
        change = "lower train.global_batch or data.seq_len"
    for factor in (2, 4, 8):
        more = Cluster(cluster.gpus * factor, cluster.gpus_per_node, cluster.device)
        found = rank_plans(cfg, more, fixed)
        if found and found[0].fits:
            change = f"use {more.gpus} GPUs (then {_layout(found[0])})"
            break
    raise ConfigError("plan", f"model '{model}' does not fit on {cluster.gpus} x "
                      f"{cluster.device.name}: {cause} of "
                      f"{cluster.device.memory_bytes / 1e9:.0f} GB; smallest change: {change}")


def _state_on_device(p: Plan) -> float:
    """A plan's device bytes less its activations (its model state at its peak, or at start-up)."""
    return p.peak_memory_bytes - p.memory_bytes["activations"]


def _layout(p: Plan) -> str:
    d = p.degrees
    return (f"tp {d['tp']}, pp {d['pp']}, cp {d['cp']}, ep {d['ep']}, dp {d['dp']}, "
            f"ZeRO-{d['zero']}, "
            + (f"{d['offload']} offload, " if d["offload"] != "none" else "")
            + f"{d['activation_checkpointing']} checkpointing")


def print_plans(plans: list[Plan], cluster: Cluster, top: int, params: int) -> None:
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
                      d["pp_schedule"] if d["pp"] > 1 else "-", d["activation_checkpointing"],
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


def as_json(plans: list[Plan], top: int) -> str:
    return json.dumps([p.as_json() for p in plans[:top]], indent=1)


def write_recipe(path: str, cfg: Config, plan: Plan, cluster: Cluster) -> None:
    """A TOML recipe with the plan's degrees (dp left to the world size)."""
    d = plan.degrees
    sections = {
        "model": {"preset": cfg.model.preset, **cfg.model.overrides},
        "parallel": {k: d[k] for k in ("tp", "pp", "cp", "ep", "zero", "dp_shard",
                                       "microbatches", "pp_schedule", "sequence_parallel",
                                       "cp_method", "offload")},
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
