"""`plait bench pp --nproc P [overrides]`: pipeline schedules, simulated, measured, and against
`torch.distributed.pipelining` on the same model chunks, batch and seed.

Per schedule: the simulated bubble (ideal clock, unit costs) beside the closed form; the measured
bubble of a real step (each stage's idle share of the step's span, worst stage, from the
executor's per-action timestamps; all ranks share one monotonic clock on one machine), and
between them the same step replayed on the simulator with each action's measured duration and
free messages, which says how much of the gap is the compute's own costs (unequal stages, a
backward that is not two forwards) and how much messages and the executor; the peak
number of in-flight micro-batch activations per stage; the median step time of plait and of
torch's ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B (ZB-H1 has no torch peer in this
table). The measured timelines are drawn to a PNG, one row per stage.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from plait import comm
from plait.bench.step import start_worker
from plait.comm.trace import TRACER, pipeline_spans
from plait.config.choices import PP_SCHEDULES
from plait.config.schema import Config, ConfigError
from plait.data.batches import TokenData
from plait.launch import launch
from plait.model import build_model
from plait.parallel import Options, parallelize
from plait.parallel.pipeline.schedules import Kind, build_schedule
from plait.parallel.pipeline.simulator import simulate, textbook_bubble
from plait.parallel.pipeline.stage import split_model
from plait.train.checks import validate
from plait.train.progress import each
from plait.train.report import draw_timelines

TORCH_PEERS = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
               "interleaved": ScheduleInterleaved1F1B}


def with_schedule(cfg: Config, name: str) -> Config:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp_schedule=name))


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _time_plait(cfg: Config, mesh, batches, steps: int):
    model = build_model(cfg.model.args(), cfg.train.seed)
    par = parallelize(model, mesh, cfg.parallel, Options(microbatches=len(batches)))
    del model
    opt = torch.optim.AdamW([p for g in par.optimizer_groups() for p in g], lr=1e-4)
    times = []
    for i in range(steps + 1):  # one warm-up step
        comm.all_reduce(torch.zeros(1), mesh["pp"].get_group())  # start together
        opt.zero_grad(set_to_none=True)
        if i == steps:  # the last step's actions, for the timeline
            TRACER.start(dist.get_rank())
        start = time.perf_counter()
        par.pipeline.run(batches)
        par.finish_gradients()
        opt.step()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times), pipeline_spans(TRACER.take())


def _time_torch(cfg: Config, name: str, rank: int, P: int, x, y, steps: int) -> float:
    V = cfg.parallel.pp_virtual if name == "interleaved" else 1
    chunks = split_model(build_model(cfg.model.args(), cfg.train.seed), P * V,
                         list(cfg.parallel.pp_split) or None)
    stages = [PipelineStage(chunks[c], c, P * V, torch.device("cpu"))
              for c in range(P * V) if c % P == rank]
    M = cfg.parallel.microbatches or P
    schedule = TORCH_PEERS[name](stages if V > 1 else stages[0], n_microbatches=M,
                                 loss_fn=_cross_entropy)
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    times = []
    for i in range(steps + 1):
        comm.all_reduce(torch.zeros(1), dist.group.WORLD)
        opt.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == P - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@record
def bench_pp(cfg: Config, schedules: list[str], steps: int) -> dict:
    """On every rank (one per stage): plait's and torch's median step time per schedule, and
    this stage's measured spans of plait's last step."""
    _, mesh = start_worker(cfg)
    rank, P = dist.get_rank(), dist.get_world_size()
    x, y = TokenData(cfg.data, cfg.train.seed).batch(0, cfg.train.global_batch)
    M = cfg.parallel.microbatches or P
    batches = list(zip(x.split(len(x) // M), y.split(len(x) // M), strict=True))
    out = {}
    for name in each(schedules, "bench pp: schedule", enabled=rank == 0):
        plait_s, spans = _time_plait(with_schedule(cfg, name), mesh, batches, steps)
        torch_s = _time_torch(cfg, name, rank, P, x, y, steps) if name in TORCH_PEERS else None
        out[name] = {"plait": plait_s, "torch": torch_s, "spans": spans}
    dist.destroy_process_group()
    return out


def replayed(schedule, stage_spans: list[list[tuple]]):
    """The schedule simulated with each action's measured duration and free messages (what the
    measured bubble would be if only the compute's real costs counted: a backward dearer than
    two forwards, the last stage's head and loss, stages of unequal cost)."""

    took = {(Kind(kind), mb, chunk): end - start
            for spans in stage_spans for kind, mb, chunk, start, end in spans}
    return simulate(schedule, lambda stage, a: took[(a.kind, a.microbatch, a.chunk)])


def stage_costs(stage_spans: list[list[tuple]]) -> list[dict[str, float]]:
    """Per stage, the mean seconds of its actions of each kind (F, B, W)."""
    out = []
    for spans in stage_spans:
        kinds: dict[str, list[float]] = {}
        for kind, _, _, start, end in spans:
            kinds.setdefault(kind, []).append(end - start)
        out.append({k: statistics.fmean(v) for k, v in kinds.items()})
    return out


def why_bubble(name: str, formula: float, replay: float, measured: float,
               costs: list[dict[str, float]]) -> str:
    """One line: the formula's bubble, what the measured compute costs make of it, and what is
    left for messages and the executor between actions."""
    per_kind = ", ".join(f"{k} " + "/".join(f"{c[k] * 1e3:.1f}" for c in costs)
                         for k in ("F", "B", "W") if all(k in c for c in costs))
    ratio = statistics.fmean((c["B"] + c.get("W", 0.0)) / c["F"] for c in costs)
    units = "F = B = W" if name == "zb1" else "B = 2F"
    return (f"{name}: formula {formula:.3f} (unit costs, {units}); the step's own costs (ms per "
            f"stage: {per_kind}; backward / forward {ratio:.2f}) replayed with free messages make "
            f"it {replay:.3f}; the other {measured - replay:+.3f} of the measured {measured:.3f} "
            "is waiting on messages and the executor between actions")


def measured_bubble(stage_spans: list[list[tuple]]) -> float:
    """Worst stage's idle share of the step's span (first start to last end over all stages)."""
    begin = min(s[3] for spans in stage_spans for s in spans)
    end = max(s[4] for spans in stage_spans for s in spans)
    busy = [sum(s[4] - s[3] for s in spans) for spans in stage_spans]
    return max(1 - b / (end - begin) for b in busy)


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
