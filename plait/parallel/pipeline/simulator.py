"""Prove a schedule sound (`check`) and run it on an ideal clock (`simulate`).

Both play the schedule out with the dependencies of `schedules.py`: each stage takes its actions
in order, an action starts when its stage is free and everything it needs has finished (messages
cost nothing). If no stage can move while actions remain, the schedule deadlocks; the first stuck
action is named, with what it waits for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from plait.parallel.pipeline.schedules import Action, Kind, Schedule, ScheduleError


def dependencies(schedule: Schedule, a: Action) -> list[Action]:
    if a.kind is Kind.F:
        return [Action(Kind.F, a.microbatch, a.chunk - 1)] if a.chunk > 0 else []
    if a.kind is Kind.B:
        deps = [Action(Kind.F, a.microbatch, a.chunk)]
        if a.chunk < schedule.chunks - 1:
            deps.append(Action(Kind.B, a.microbatch, a.chunk + 1))
        return deps
    return [Action(Kind.B, a.microbatch, a.chunk)]


def default_costs(schedule: Schedule) -> dict[Kind, float]:
    """Unit time per forward, 2 per backward (split: 1 input-gradient + 1 weight-gradient)."""
    if schedule.split_backward:
        return {Kind.F: 1.0, Kind.B: 1.0, Kind.W: 1.0}
    return {Kind.F: 1.0, Kind.B: 2.0, Kind.W: 0.0}


@dataclass
class Timeline:
    spans: list[list[tuple[Action, float, float]]]  # per stage: (action, start, end)
    makespan: float
    busy: list[float] = field(default_factory=list)  # per stage
    peak_in_flight: list[int] = field(default_factory=list)  # per stage: micro-batch activations

    @property
    def bubble(self) -> float:
        """Idle share of the makespan, worst stage."""
        return max(1 - b / self.makespan for b in self.busy)


def _play(schedule: Schedule, cost: Callable[[int, Action], float]) -> Timeline:
    finish: dict[Action, float] = {}
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(schedule.stages)]
    pos, clock = [0] * schedule.stages, [0.0] * schedule.stages
    remaining = sum(len(seq) for seq in schedule.actions)
    while remaining:
        moved = False
        for s, seq in enumerate(schedule.actions):
            while pos[s] < len(seq):
                a = seq[pos[s]]
                deps = dependencies(schedule, a)
                if any(d not in finish for d in deps):
                    break
                start = max([clock[s], *(finish[d] for d in deps)])
                clock[s] = finish[a] = start + cost(s, a)
                spans[s].append((a, start, clock[s]))
                pos[s] += 1
                remaining -= 1
                moved = True
        if not moved:
            s = next(s for s in range(schedule.stages) if pos[s] < len(schedule.actions[s]))
            a = schedule.actions[s][pos[s]]
            missing = [str(d) for d in dependencies(schedule, a) if d not in finish]
            raise ScheduleError(
                f"{schedule.name}: deadlock at stage {s}, action {pos[s]}: {a} waits for "
                f"{', '.join(missing)}, which can never run before it"
            )
    busy = [sum(end - start for _, start, end in stage) for stage in spans]
    return Timeline(spans, max(clock), busy, _peak_in_flight(schedule))


def _peak_in_flight(schedule: Schedule) -> list[int]:
    """Micro-batch activations a stage holds at worst."""
    return [peak_held(schedule, stage) for stage in range(schedule.stages)]


def peak_held(schedule: Schedule, stage: int, weight=lambda chunk: 1) -> int:
    """The most a stage holds at once when each F of a chunk adds `weight(chunk)` (one
    micro-batch's activations, by default) and the pass that last needs them (B, or W when the
    backward is split) frees it."""
    release = Kind.W if schedule.split_backward else Kind.B
    held = peak = 0
    for a in schedule.actions[stage]:
        if a.kind is Kind.F:
            held += weight(a.chunk)
            peak = max(peak, held)
        elif a.kind is release:
            held -= weight(a.chunk)
    return peak


def _messages(schedule: Schedule):
    """Per (sender, receiver) pair: what the sender sends, in its order, and what the receiver
    takes, in its order, with the receiving action's position."""
    sent: dict[tuple[int, int], list] = {}
    taken: dict[tuple[int, int], list] = {}
    last = schedule.chunks - 1
    for s, seq in enumerate(schedule.actions):
        for i, a in enumerate(seq):
            if a.kind is Kind.F and a.chunk < last:  # activation to the next chunk
                sent.setdefault((s, schedule.stage_of(a.chunk + 1)), []).append((a.chunk, a))
            if a.kind is Kind.B and a.chunk > 0:  # gradient to the previous chunk
                sent.setdefault((s, schedule.stage_of(a.chunk - 1)), []).append((a.chunk, a))
            if a.kind is Kind.F and a.chunk > 0:
                key = (schedule.stage_of(a.chunk - 1), s)
                taken.setdefault(key, []).append(
                    (a.chunk - 1, Action(Kind.F, a.microbatch, a.chunk - 1), i, a))
            if a.kind is Kind.B and a.chunk < last:
                key = (schedule.stage_of(a.chunk + 1), s)
                taken.setdefault(key, []).append(
                    (a.chunk + 1, Action(Kind.B, a.microbatch, a.chunk + 1), i, a))
    return sent, taken


def _check_message_order(schedule: Schedule) -> None:
    """Between two stages, messages must be taken in the order they are sent: NCCL matches
    point-to-point messages by order, not by tag (gloo would forgive it; a cluster would not)."""
    sent, taken = _messages(schedule)
    for (src, dst), expected in sorted(taken.items()):
        for (_, want, i, a), (_, got) in zip(expected, sent.get((src, dst), []), strict=False):
            if want != got:
                raise ScheduleError(
                    f"{schedule.name}: stage {dst}, action {i}: {a} takes the message of {want} "
                    f"from stage {src}, which sends that of {got} first; messages between two "
                    "stages must be taken in the order they are sent"
                )


def check(schedule: Schedule) -> None:
    """Raise ScheduleError naming the first bad action, unless every (chunk, micro-batch) has its
    F, B (and W if split) exactly once, on the chunk's stage, in an order that cannot deadlock
    and that takes the messages between any two stages in the order they were sent."""
    kinds = [Kind.F, Kind.B] + ([Kind.W] if schedule.split_backward else [])
    seen: set[Action] = set()
    for s, seq in enumerate(schedule.actions):
        for i, a in enumerate(seq):
            where = f"{schedule.name}: stage {s}, action {i}: {a}"
            if not (0 <= a.chunk < schedule.chunks and 0 <= a.microbatch < schedule.microbatches):
                raise ScheduleError(f"{where} is out of range")
            if schedule.stage_of(a.chunk) != s:
                raise ScheduleError(f"{where} belongs to stage {schedule.stage_of(a.chunk)}")
            if a.kind not in kinds:
                raise ScheduleError(f"{where}: W only exists when the backward is split")
            if a in seen:
                raise ScheduleError(f"{where} appears twice")
            seen.add(a)
    for c in range(schedule.chunks):
        for m in range(schedule.microbatches):
            for kind in kinds:
                if Action(kind, m, c) not in seen:
                    raise ScheduleError(f"{schedule.name}: {Action(kind, m, c)} is missing")
    simulate(schedule)
    _check_message_order(schedule)


def simulate(schedule: Schedule,
             costs: dict[Kind, float] | Callable[[int, Action], float] | None = None) -> Timeline:
    """Makespan, per-stage busy time and bubble on an ideal clock: each action costs its kind's
    unit (default: `default_costs`), or what `costs(stage, action)` says (a measured step's
    durations, replayed with free messages: `plait bench pp`)."""
    if callable(costs):
        return _play(schedule, costs)
    units = costs or default_costs(schedule)
    return _play(schedule, lambda stage, a: units[a.kind])


def textbook_bubble(schedule: Schedule) -> float:
    """`bubble_formula` of a built schedule (tested equal to its simulation)."""
    return bubble_formula(schedule.name, schedule.stages, schedule.microbatches,
                          schedule.chunks_per_stage)


def bubble_formula(name: str, P: int, M: int, V: int = 1) -> float:
    """The closed form, as a share of the makespan, for unit costs (F = 1, B = 2 or B = W = 1):
    GPipe and 1F1B (P - 1) / (M + P - 1); interleaved 1F1B (P - 1) / (V M + P - 1), i.e. the
    bubble time divided by V; ZB-H1 (P - 1)(F + B - W) / ((P - 1)(F + B - W) + M (F + B + W))."""
    if name == "zb1":
        return (P - 1) / (P - 1 + 3 * M)
    return (P - 1) / (V * M + P - 1)
