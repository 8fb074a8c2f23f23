"""`plait train --trace DIR [--trace-steps N]`: what N steps did on every rank, as Chrome trace
files Perfetto opens (ui.perfetto.dev, or chrome://tracing).

    DIR/rank{r}.json    each rank's own events (comm/trace.py: compute spans, pipeline actions,
                        each collective with its group and bytes); every rank writes its own,
                        so this works on several nodes without a shared folder
    DIR/trace.json      the ranks rank 0 can see, merged: one process per rank, on one clock
    DIR/pipeline.png    with pp > 1: the traced steps' timelines, one row per stage (the ranks
                        at dp = tp = ... = 0), drawn from the same events

The traced steps are those after the first (whose one-off costs, allocations and warm-up, are not
what a user looks for), unless the run has only one.
"""

from __future__ import annotations

import json
from pathlib import Path

from plait.comm import barrier
from plait.comm.trace import TRACER, merge_traces, pipeline_spans, write_trace
from plait.mesh import Axis, ParallelDims
from plait.train.report import draw_timelines

STEP = "step"  # the category of the span around each traced step


def traced_steps(total: int, count: int, start: int = 0) -> range:
    """`count` of the `total` steps from `start` on, skipping the first (one-off costs)."""
    first = 1 if total > 1 else 0
    return range(start + first, start + min(total, first + count))


def _by_step(events: list[dict]) -> dict[int, list[dict]]:
    """Each traced step's events: those that start within its span."""
    steps = [e for e in events if e.get("cat") == STEP]
    events = [e for e in events if "ts" in e]  # not the metadata
    return {s["args"]["step"]: [e for e in events if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]]
            for s in steps}


def finish_trace(folder: str, dims: ParallelDims, world: Axis) -> list[Path]:
    """Every rank writes its events; after a barrier, rank 0 merges and draws. Returns the files
    rank 0 wrote (nothing on other ranks)."""

    rank, out = world.rank, Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    write_trace(out / f"rank{rank}.json", TRACER.take(), rank, dims.coords(rank))
    barrier(world.group)  # every file is written
    if rank:
        return []
    paths = [out / f"rank{r}.json" for r in range(dims.world_size)]
    merge_traces([p for p in paths if p.is_file()], out / "trace.json")
    written = [out / "trace.json"]
    stage_ranks = [dims.rank(pp=s) for s in range(dims.pp)]
    if dims.pp > 1 and all(paths[r].is_file() for r in stage_ranks):
        stages = [_by_step(json.loads(paths[r].read_text())["traceEvents"]) for r in stage_ranks]
        timelines = {f"step {step}": [pipeline_spans(stage[step]) for stage in stages]
                     for step in sorted(stages[0])}
        draw_timelines(timelines, out / "pipeline.png")
        written.append(out / "pipeline.png")
    return written
