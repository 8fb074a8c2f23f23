"""Pipeline parallelism over the `pp` axis: schedules as data (`schedules`), their checker and
ideal-clock simulator (`simulator`), the model cut into chunks (`stage`), one executor for all
schedules (`executor`). With pp = 1 the model is one chunk and the schedule is plain gradient
accumulation over the micro-batches (F B F B ...), so every configuration trains through the same
executor."""

from __future__ import annotations

import functools

from torch import nn

from plait.config.schema import ParallelConfig
from plait.mesh import Axis
from plait.model.plan import has_plan, needs_plan
from plait.parallel.pipeline.executor import PipelineExecutor
from plait.parallel.pipeline.schedules import Schedule, build_schedule, forward_only
from plait.parallel.pipeline.simulator import check
from plait.parallel.pipeline.stage import StageModules, split_model
from plait.parallel.placement import PlacementRecord


def stage_schedule(cfg: ParallelConfig, stages: int, microbatches: int,
                   checked: bool = True) -> Schedule:
    """The schedule this configuration runs (one stage: accumulation, whatever it names: every
    schedule of one stage is F B F B ...), checked complete and deadlock-free unless the caller
    only reads its shape (the formulas)."""
    V = cfg.pp_virtual if cfg.pp_schedule == "interleaved" and stages > 1 else 1
    key = (cfg.pp_schedule if stages > 1 else "1f1b", stages, microbatches, V)
    return _checked(*key) if checked else _built(*key)


@functools.lru_cache(maxsize=1024)
def _built(name: str, stages: int, microbatches: int, virtual: int) -> Schedule:
    """Built once (the planner prices thousands of layouts; schedules are data that nothing
    modifies)."""
    return build_schedule(name, stages, microbatches, virtual)


@functools.lru_cache(maxsize=1024)
def _checked(name: str, stages: int, microbatches: int, virtual: int) -> Schedule:
    schedule = _built(name, stages, microbatches, virtual)
    check(schedule)
    return schedule


def apply_pp(model: nn.Module, pp: Axis, cfg: ParallelConfig, microbatches: int,
             record: PlacementRecord | None = None) -> tuple[StageModules, Schedule]:
    """Keep only this stage's chunks of `model`; returns them with the schedule. The record gets
    every parameter the stage holds (whole, on this pp coordinate) and loses the others."""
    schedule = stage_schedule(cfg, pp.size, microbatches)
    C = schedule.chunks
    pieces = all(hasattr(type(model), f) for f in ("embed", "block_args", "head"))
    if C == 1 and not (has_plan(model) and pieces):  # the module is its own only chunk
        chunks = [model]
    else:
        needs_plan(model, f"parallel.pp={pp.size}")
        chunks = split_model(model, C, list(cfg.pp_split) or None if C > 1 else None)
    mine = StageModules({str(c): chunks[c] for c in range(C) if c % pp.size == pp.rank})
    if record is not None:
        kept = {n for n, _ in mine.named_parameters()}
        for name, p in model.named_parameters():
            record.add(name, tuple(p.shape))
            if name in kept:
                record.shard(name, "pp", None)
            else:
                record.drop(name)
    return mine, schedule


__all__ = ["PipelineExecutor", "StageModules", "apply_pp", "forward_only", "stage_schedule"]


def fewest_microbatches(cfg: ParallelConfig, stages: int, microbatches: int, stage: int) -> int:
    """The fewest micro-batches whose schedule holds on `stage`, at its fullest, what the step's
    schedule of `microbatches` holds: per action (its kind and chunk, at its start and at its
    end) the same most-held sets of micro-batches in flight per chunk (between their F and B,
    and between B and W where the backward is split). What a stage keeps for backward is, at
    any moment, a sum over the micro-batches in flight of what each keeps on its chunk, plus
    what the action under way holds (a recomputation, the forward being saved), so a step
    traced with that many keeps the same activations at its peak, whatever each chunk's
    micro-batch keeps, and runs the step's FLOPs times that many / `microbatches` (a 1F1B stage
    holds at most `stages` micro-batches whatever the step's number). `microbatches` where no
    fewer do."""
    want = _fullest(stage_schedule(cfg, stages, microbatches, checked=False), stage)
    for fewer in range(1, microbatches):
        try:
            schedule = stage_schedule(cfg, stages, fewer)
        except ValueError:  # not a count this schedule runs (ScheduleError)
            continue
        if _fullest(schedule, stage) == want:
            return fewer
    return microbatches


def _fullest(schedule: Schedule, stage: int) -> dict:
    """Per (action kind, chunk, "start" | "end"), the maximal (by inclusion of counts) states of
    what the stage holds then: per (chunk, kind of the last pass run) its micro-batches."""
    held: dict[tuple, int] = {}
    seen: dict[tuple, set] = {}

    def note(key):
        seen.setdefault(key, set()).add(frozenset((k, v) for k, v in held.items() if v))

    for a in schedule.actions[stage]:
        note((a.kind.value, a.chunk, "start"))
        if a.kind.value != "F":
            held[(a.chunk, "F" if a.kind.value == "B" else "B")] -= 1
        if a.kind.value != "W" and (a.kind.value == "F" or schedule.split_backward):
            held[(a.chunk, a.kind.value)] = held.get((a.chunk, a.kind.value), 0) + 1
        note((a.kind.value, a.chunk, "end"))
    return {key: frozenset(s for s in states if not any(_below(s, t) for t in states))
            for key, states in seen.items()}


def _below(s: frozenset, t: frozenset) -> bool:
    """Whether state `s` is strictly inside `t` (no count above t's, and not equal)."""
    counts = dict(t)
    return s != t and all(v <= counts.get(k, 0) for k, v in s)
