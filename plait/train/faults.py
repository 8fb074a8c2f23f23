"""Injected faults, for the tests of what survives them: `PLAIT_FAULT="POINT:RANK:STEP"` makes
rank RANK kill itself (SIGKILL: no cleanup, as a lost machine) at POINT of step STEP, on a job's
first attempt only (an elastic restart runs clean). Points: `step` (before the optimizer step
STEP, counted from 0) and `save` (while writing the checkpoint of step STEP)."""

from __future__ import annotations

import os
import signal

import torch.distributed as dist

ENV = "PLAIT_FAULT"


def maybe_fail(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    where, rank, at = spec.split(":")
    if where == point and int(at) == step and int(rank) == dist.get_rank():
        os.kill(os.getpid(), signal.SIGKILL)
