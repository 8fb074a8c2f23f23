"""Where a run writes what it shows: kept apart from the trainer so that the command line can
name the outputs without importing the training stack (seconds of imports in the launcher)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Outputs:
    """Where a run reports besides its summary: rank 0 writes the metrics, the TensorBoard
    scalars and the progress; every rank writes its trace."""

    metrics: str | None = None
    tensorboard: str | None = None
    trace: str | None = None
    trace_steps: int = 1
    progress: bool = False


def creatable(target: Path, ancestor: Path, folder: bool) -> str | None:
    """Create `target` (a file, or `folder`) and the folders between it and its existing
    `ancestor`, as a run will, then remove them; the system's reason where it cannot (root
    passes every access test, and /sys, /proc or a read-only mount still refuse)."""
    made = [p for p in [target, *target.parents] if p != ancestor and ancestor in p.parents]
    done = []
    try:
        for p in reversed(made):
            try:
                if p == target and not folder:
                    p.open("x").close()
                else:
                    p.mkdir()
            except FileExistsError:  # made meanwhile by another process (the job's other node
                continue  # checking the same path): creatable, and not ours to remove
            done.append(p)
    except OSError as e:
        return e.strerror or str(e)
    finally:
        for p in reversed(done):
            p.unlink() if p == target and not folder else p.rmdir()
    return None
