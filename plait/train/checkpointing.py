"""When and how a run saves its checkpoints (`checkpoint.*`): every `every` steps and when it ends
or stops, synchronously or in the background, keeping the newest `keep`.

Saving runs its collectives on a gloo group of its own, so that a background save never
interleaves with the training's collectives (and works on the CPU side of an NCCL job).
`checkpoint.async`: the state is copied into host memory (all the training waits for), then DCP
writes it from a thread; rank 0 marks the checkpoint complete at the first step boundary after
the write has finished on every rank (or at the next save, or the end of the run).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from plait.checkpoint import finish, meta, step_path
from plait.checkpoint.layout import Boxes, SaveBoxes
from plait.checkpoint.rank_state import training_state
from plait.comm import barrier
from plait.config.schema import Config
from plait.train.faults import maybe_fail


class CopyStager:
    """DCP's async stager protocol: a copy of the state in host memory, made before returning."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        def copy(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", copy=True)

        return {k: Boxes(v.size(), [(o, copy(t)) for o, t in v.boxes]) if isinstance(v, Boxes)
                else copy(v) for k, v in state_dict.items()}

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written: where, why, on which ranks; its partial step
    folder removed."""


def _os_error(e: BaseException) -> OSError | None:
    """The OSError in an exception's chain (the disk's own word: ENOSPC, EDQUOT, EROFS, ...)."""
    while e is not None:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def write_failed(path: Path, error: BaseException, is_rank0: bool) -> CheckpointWriteError | None:
    """What a save that the file system refused says, once every rank's write has ended (DCP
    gathered them all): the path, the system's reason and the ranks; rank 0 removes the partial
    step folder, which would keep the disk full. A full disk shows as ENOSPC on some rank, or
    only as a short write inside torch.save's zip writer ("unexpected pos"): the free space,
    read before the removal, says. None for any other failure (a peer lost mid-save: its own
    traceback says more), after the same removal."""
    failures = {r: e for r, (e, _) in error.failures.items()} \
        if isinstance(error, CheckpointException) else {None: error}
    found = [e for e in map(_os_error, failures.values()) if e is not None and e.errno]
    free = shutil.disk_usage(path.parent).free if path.parent.exists() else None
    if is_rank0:
        shutil.rmtree(path, ignore_errors=True)
    if any(e.errno in (errno.ENOSPC, errno.EDQUOT) for e in found) or \
            (free is not None and free < FULL):
        why = os.strerror(errno.ENOSPC) + (f" ({free / 2**20:.1f} MiB free)" if free is not None
                                          else "")
    elif found:
        why = os.strerror(found[0].errno)
    else:
        return None
    ranks = ", ".join(str(r) for r in failures if r is not None)
    return CheckpointWriteError(
        f"the checkpoint could not be written to {path}: {why}"
        + (f" on rank(s) {ranks}" if ranks else "")
        + "; the partial checkpoint was removed: free space or set checkpoint.dir elsewhere")


FULL = 2**20  # bytes free below which a failed write is taken for a full disk


class Checkpointer:
    def __init__(self, cfg: Config, extra: dict | None = None):
        """`extra`: entries of each checkpoint's plait.json besides `meta`'s."""
        self.cfg, self.ck, self.extra = cfg, cfg.checkpoint, extra or {}
        self._group = None
        self.is_rank0 = dist.get_rank() == 0
        self.pending: tuple[Future, object, dict] | None = None  # a background save

    @property
    def group(self) -> dist.ProcessGroup:
        """Made at the first load or save, which every rank reaches at the same point."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def due(self, done: int, last: int) -> bool:
        """Whether to save after `done` steps of a run that stops after `last`."""
        every = self.ck.every
        return bool(self.ck.dir) and (done == last or (every > 0 and done % every == 0))

    def save(self, step: int, parallelized, optimizer: torch.optim.Optimizer) -> None:
        self.wait()  # one save at a time
        path = step_path(self.ck.dir, step)
        if self.is_rank0:
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(path, ignore_errors=True)  # an unfinished earlier attempt
        barrier(self.group)
        state = training_state(parallelized, optimizer, step)
        info = {**meta(self.cfg, step, dist.get_world_size()), **self.extra}
        planner = SaveBoxes(functools.partial(maybe_fail, "save", step))
        args = dict(checkpoint_id=str(path), planner=planner, process_group=self.group)
        if not self.ck.async_:
            with self._refusal_said(path):
                dcp.save(state, **args)
            self._finish(path, info)
            return
        response = dcp.async_save(state, async_stager=CopyStager(), **args)
        self.pending = getattr(response, "upload_completion", response), path, info

    @contextlib.contextmanager
    def _refusal_said(self, path: Path):
        """A save's failure: the file system's refusal in one line (`write_failed`), any other
        as raised (the partial folder removed either way)."""
        try:
            yield
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            said = write_failed(path, e, self.is_rank0)
            if said is None:
                raise
            raise said from None

    def _finish(self, path, info: dict) -> None:
        """Every rank's write is done once DCP's save returns on rank 0 (its coordinator gathers
        them all before writing the metadata): rank 0 marks the checkpoint complete."""
        if self.is_rank0:
            finish(path, info, self.ck.keep)

    def poll(self) -> None:
        """Between steps: finish a background save that has finished writing."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Until a background save has finished (raising its error, if any); then mark it."""
        if self.pending is not None:
            (future, path, info), self.pending = self.pending, None
            with self._refusal_said(path):
                future.result()
            self._finish(path, info)
