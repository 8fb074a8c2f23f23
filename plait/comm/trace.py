"""A per-rank trace of what a step did, in Chrome's trace-event format (read by Perfetto and
chrome://tracing): `plait train --trace DIR` and the pipeline bench's measured timelines.

`TRACER` is process-wide, like the ledger, so that the collectives inside autograd functions and
the pipeline's actions are traced without threading a recorder through every call; it is off
(one attribute test per event) unless a run turns it on. Events:

    compute    "X" spans on the rank's main thread: the step, each pipeline action (F, B, W with
               its micro-batch and chunk), finishing the gradients, the norm, the optimizer;
               a blocking collective nests inside the span that issued it
    collective name = the op; args: the group's global ranks, the tensor's bytes, and the bytes
               it moves per rank by the ring convention (what the ledger adds). A blocking one is
               an "X" span; an asynchronous one is an async pair ("b"/"e") from its launch to the
               end of its wait, drawn on a track of its own (its true finish lies in between)

Timestamps are wall-clock microseconds at perf_counter resolution, so ranks on one machine line
up exactly and ranks on several line up as well as their clocks agree.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

PIPELINE = "pipeline"  # the category of pipeline actions: the timeline picture draws these


class EventTracer:
    def __init__(self):
        self.on = False
        self.events: list[dict] = []
        self.pid = 0
        self._offset = 0.0  # wall clock - perf_counter, seconds
        self._next_id = 0

    def start(self, rank: int) -> None:
        """Record from now on; events already recorded are kept (start after pause resumes)."""
        self.on, self.pid, self._offset = True, rank, time.time() - time.perf_counter()

    def pause(self) -> None:
        self.on = False

    def take(self) -> list[dict]:
        """Everything recorded; recording off and forgotten."""
        events, self.events, self.on = self.events, [], False
        return events

    def _us(self, t: float) -> float:
        return (t + self._offset) * 1e6

    def complete(self, name: str, cat: str, start: float, end: float, **args) -> None:
        """A span on the main thread, `start` and `end` from time.perf_counter()."""
        if self.on:
            self.events.append({"name": name, "cat": cat, "ph": "X", "ts": self._us(start),
                                "dur": (end - start) * 1e6, "pid": self.pid, "tid": 0,
                                "args": args})

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute", **args):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, cat, start, time.perf_counter(), **args)

    def overlapping(self, name: str, cat: str, start: float, end: float, **args) -> None:
        """A span that may overlap others on its thread (an asynchronous collective)."""
        if self.on:
            self._next_id += 1
            common = {"name": name, "cat": cat, "pid": self.pid, "tid": 0, "id": self._next_id}
            self.events.append({**common, "ph": "b", "ts": self._us(start), "args": args})
            self.events.append({**common, "ph": "e", "ts": self._us(end)})


TRACER = EventTracer()


def write_trace(path: str | Path, events: list[dict], rank: int, coords: dict[str, int]) -> None:
    """One rank's trace file; `coords` (its place on the mesh) names the process."""
    label = f"rank {rank} (" + ", ".join(f"{a} {i}" for a, i in coords.items()) + ")"
    meta = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": label}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}]
    Path(path).write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms",
                                      "otherData": {"rank": rank, "coords": coords}}))


def merge_traces(paths: list[Path], out: str | Path) -> None:
    """The ranks' traces as one file: one process per rank in Perfetto."""
    events, ranks = [], {}
    for path in paths:
        trace = json.loads(Path(path).read_text())
        events += trace["traceEvents"]
        ranks[trace["otherData"]["rank"]] = trace["otherData"]["coords"]
    Path(out).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                     "otherData": {"ranks": ranks}}))


def pipeline_spans(events: list[dict]) -> list[tuple[str, int, int, float, float]]:
    """(kind, micro-batch, chunk, start s, end s) of each pipeline action among `events`."""
    return [(e["args"]["kind"], e["args"]["microbatch"], e["args"]["chunk"], e["ts"] / 1e6,
             (e["ts"] + e["dur"]) / 1e6) for e in events
            if e.get("cat") == PIPELINE and e["ph"] == "X"]
