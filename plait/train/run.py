"""One worker's whole job: process group, mesh, trainer, summary. Started by plait's launcher or by
torchrun; either way the usual environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) describes the world.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from plait import forkserver
from plait.comm.watchdog import Heartbeat, diagnose, is_timeout
from plait.config.schema import Config
from plait.mesh import build_mesh
from plait.train.checks import validate
from plait.train.outputs import Outputs
from plait.train.progress import print_summary


def worker_device(choice: str = "auto") -> torch.device:
    """`train.device`: "cpu", "cuda" (this worker's GPU, cuda:LOCAL_RANK), or "auto" (cuda when
    there is one). A CPU run on a machine with a GPU stays on the CPU when asked to."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within parallel.timeout_s; the message names who is late."""


def _heartbeat(timeout_s: float) -> tuple[object, Heartbeat, float] | None:
    """This rank's heartbeat on the job's store (the launcher's, at MASTER_ADDR:MASTER_PORT)."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    interval = min(2.0, timeout_s / 5)
    return store, Heartbeat(store, dist.get_rank(), interval).start(), interval


@record
def run_training(cfg: Config, outputs: Outputs | None = None, verify: bool = False):
    """Train on the world the environment describes; rank 0 shows progress and the summary. A
    collective that does not complete within parallel.timeout_s ends the job with a message
    naming the ranks that did not arrive. `verify`: instead, one step against one process
    (`train/verify.py`); returns the verdict, the same on every rank (else None)."""
    trainer_class = importlib.import_module(forkserver.TRAINER).Trainer  # the forkserver's import
    torch.set_num_threads(cfg.train.threads)
    device = worker_device(cfg.train.device)
    timeout_s = cfg.parallel.timeout_s
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=timedelta(seconds=timeout_s))
    watch = _heartbeat(timeout_s)
    try:
        dims = validate(cfg, dist.get_world_size())
        trainer = trainer_class(cfg, dims, build_mesh(dims, device.type), device, verify)
        if verify:
            verdict = trainer.verify()
            dist.destroy_process_group()
            return verdict
        if trainer.resumed_from is not None and dist.get_rank() == 0:
            print(f"plait: resumed from {trainer.resumed_from} at step {trainer.start_step}",
                  flush=True)
        summary = trainer.fit(dataclasses.replace(outputs or Outputs(), progress=True))
        if dist.get_rank() == 0:
            print_summary(summary, dist.get_world_size())
    except RuntimeError as e:
        if watch is None or not is_timeout(e):
            raise
        store, _, interval = watch
        raise CollectiveTimeout(f"rank {dist.get_rank()}: " + diagnose(
            store, dist.get_world_size(), interval, timeout_s)) from e
    finally:
        if watch is not None:
            watch[1].stop()
    dist.destroy_process_group()
    # nothing more returned: the summary was printed, and the launcher would import the trainer
    # (2 s) to unpickle it
    return None
