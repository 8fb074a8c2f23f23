"""Pipeline schedules as data: for each stage, the ordered list of actions it performs.

The model is cut into C = P * V chunks; chunk c runs on stage c % P (V > 1 only for the interleaved
schedule, where stage s holds chunks s, s + P, s + 2P, ...). An action is a forward (F), a backward
(B) or, for zero-bubble schedules whose backward is split in two, the weight-gradient pass (W; B is
then the input-gradient pass) of one micro-batch on one chunk. Communication is implied:

    F(c, m) needs F(c - 1, m): the activation, sent from chunk c - 1's stage
    B(c, m) needs F(c, m) and B(c + 1, m): the gradient, sent from chunk c + 1's stage
    W(c, m) needs B(c, m)

`check` proves a schedule complete, deadlock-free and dependency-respecting; `simulate` runs it on
an ideal clock. One executor (`executor.py`) runs any schedule that passes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from plait.config.choices import PP_SCHEDULES


class Kind(enum.Enum):
    F = "F"
    B = "B"
    W = "W"


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind.value}(mb={self.microbatch}, chunk={self.chunk})"


@dataclass
class Schedule:
    name: str
    stages: int  # P
    microbatches: int  # M
    chunks_per_stage: int  # V
    split_backward: bool  # B is the input gradient only, W the weight gradient
    actions: list[list[Action]]  # per stage, in order

    @property
    def chunks(self) -> int:
        return self.stages * self.chunks_per_stage

    def stage_of(self, chunk: int) -> int:
        return chunk % self.stages


class ScheduleError(ValueError):
    pass


# -- the schedules ---------------------------------------------------------------------------------


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (Huang et al. 2019). Holds M micro-batches' activations."""
    actions = [[Action(Kind.F, m, s) for m in range(microbatches)]
               + [Action(Kind.B, m, s) for m in range(microbatches)] for s in range(stages)]
    return Schedule("gpipe", stages, microbatches, 1, False, actions)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B, PipeDream-flush (Narayanan et al. 2021): P - s - 1 warm-up forwards, then one forward
    and one backward in turn, then the remaining backwards. Same bubble as GPipe, but stage s holds
    at most P - s micro-batches' activations."""
    out = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        seq = [Action(Kind.F, m, s) for m in range(warmup)]
        for i in range(microbatches - warmup):
            seq += [Action(Kind.F, warmup + i, s), Action(Kind.B, i, s)]
        seq += [Action(Kind.B, m, s) for m in range(microbatches - warmup, microbatches)]
        out.append(seq)
    return Schedule("1f1b", stages, microbatches, 1, False, out)


def interleaved_1f1b(stages: int, microbatches: int, chunks_per_stage: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2): each stage holds V chunks and runs
    micro-batches through them in groups of P, which divides the bubble by V. Needs M % P == 0."""
    P, M, V = stages, microbatches, chunks_per_stage
    if M % P:
        raise ScheduleError(f"interleaved 1F1B needs microbatches ({M}) divisible by stages ({P})")
    total = M * V

    def local(k: int, backward: bool) -> tuple[int, int]:
        """The k-th forward (or backward) of a stage: (micro-batch, local chunk index)."""
        v = (k // P) % V
        return (k // (P * V)) * P + k % P, (V - 1 - v) if backward else v

    out = []
    for s in range(P):
        warmup = min((P - s - 1) * 2 + (V - 1) * P, total)
        seq = []
        for k in range(warmup):
            m, v = local(k, False)
            seq.append(Action(Kind.F, m, v * P + s))
        for i in range(total - warmup):
            m, v = local(warmup + i, False)
            seq.append(Action(Kind.F, m, v * P + s))
            m, v = local(i, True)
            seq.append(Action(Kind.B, m, v * P + s))
        for i in range(total - warmup, total):
            m, v = local(i, True)
            seq.append(Action(Kind.B, m, v * P + s))
        out.append(seq)
    return Schedule("interleaved", P, M, V, False, out)


def zb_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3): 1F1B with each
    backward split into B (input gradient, what the previous stage waits for) and W (weight
    gradient, which nobody waits for). Stage s keeps up to s of its W passes pending, so that the
    later stages, which feed the gradients, send each B on without a W in between; the pending W
    passes fill the idle slots and the cool-down. Stage s then holds at most P activations, 1F1B's
    peak."""
    out, base_schedule = [], one_f_one_b(stages, microbatches)
    for s in range(stages):
        base = base_schedule.actions[s]
        delay = s
        seq, pending = [], []
        for action in base:
            if action.kind is Kind.F:
                seq.append(action)
                continue
            seq.append(action)  # B: the input gradient
            pending.append(Action(Kind.W, action.microbatch, s))
            if len(pending) > delay:
                seq.append(pending.pop(0))
        out.append(seq + pending)
    return Schedule("zb1", stages, microbatches, 1, True, out)


def forward_only(stages: int, microbatches: int, chunks_per_stage: int = 1) -> Schedule:
    """Forwards only (evaluation): each stage runs its chunks micro-batch by micro-batch."""
    actions = [[Action(Kind.F, m, v * stages + s) for m in range(microbatches)
                for v in range(chunks_per_stage)] for s in range(stages)]
    return Schedule("forward", stages, microbatches, chunks_per_stage, False, actions)


def build_schedule(name: str, stages: int, microbatches: int, chunks_per_stage: int = 1):
    if name == "gpipe":
        return gpipe(stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stages, microbatches)
    if name == "interleaved":
        return interleaved_1f1b(stages, microbatches, chunks_per_stage)
    if name == "zb1":
        return zb_h1(stages, microbatches)
    raise ScheduleError(f"unknown schedule '{name}'; one of {', '.join(PP_SCHEDULES)}")

