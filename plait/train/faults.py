"""Injected faults, for the tests of what survives them: `PLAIT_FAULT="POINT:RANK:STEP"` makes
rank RANK kill itself (SIGKILL: no cleanup, as a lost machine) at POINT of step STEP, on a job's
first attempt only (an elastic restart runs clean). Points: `step` (before the optimizer step
STEP, counted from 0), `save` (while writing the checkpoint of step STEP), and `node` (before
the optimizer step STEP, RANK counted on its node (LOCAL_RANK): the process kills its launcher,
torchrun's agent, and itself, as a lost node (the node's other processes lose their peers and
fail, with no agent to restart them); set it in one node's environment only)."""

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
    if ("step" if where == "node" else where) != point or int(at) != step:
        return
    if where == "node":
        if int(rank) == int(os.environ.get("LOCAL_RANK", "0")):
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: nothing restarts this node
            os.kill(os.getpid(), signal.SIGKILL)
    elif int(rank) == dist.get_rank():
        os.kill(os.getpid(), signal.SIGKILL)
