"""Where a run writes what it shows: kept apart from the trainer so that the command line can
name the outputs without importing the training stack (seconds of imports in the launcher)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Outputs:
    """Where a run reports besides its summary: rank 0 writes the metrics, the TensorBoard
    scalars and the progress; every rank writes its trace."""

    metrics: str | None = None
    tensorboard: str | None = None
    trace: str | None = None
    trace_steps: int = 1
    progress: bool = False
