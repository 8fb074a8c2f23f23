"""The launcher's forkserver (`plait.launch`), startable before the launcher imports torch.

The workers are forked from a server process that imported torch and the training stack once
(`launch`). Started as soon as the job is checked, that server imports them while the launcher
imports torch for itself: on two cores the two imports overlap, and a job's workers start ~0.8 s
sooner (the server's imports take 3 s here, the launcher's 1.2). Nothing here imports torch."""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import sys

LAUNCHER = "plait.launch"  # the module whose `_worker` every worker runs
# What a training job's workers import: their entrypoint's module and the trainer it imports on
# starting (`train/run.py`); with a Hugging Face model, transformers' modeling code.
TRAINER = "plait.train.trainer"  # imported by a worker after starting, never by the launcher
TRAINING = ("plait.train.run", TRAINER)
HF = ("plait.model.hf", "transformers.modeling_utils")
SERVER = "PLAIT_FORKSERVER_OF"  # the pid of the process that starts a server, for the server


def _exit_at_once_in_the_server() -> None:
    """In the server alone (this module is the first it imports, and its parent named itself in
    SERVER): the server ends with os._exit when it exits, after every other exit handler, without
    the interpreter's teardown of torch's modules. That teardown took 1 s at every job's end, and
    whoever reads the job's output waits for the server's copy of it to close. The server has
    nothing to flush; its workers end with os._exit already."""
    if os.environ.get(SERVER) == str(os.getppid()):
        atexit.register(os._exit, 0)  # registered first, so run last


_exit_at_once_in_the_server()


def worker_environment(threads: int) -> None:
    """What the workers inherit from this process's environment: their intra-op threads, and
    gloo on the loopback interface (it otherwise picks the one the hostname resolves to)."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def start(modules: list[str], threads: int) -> None:
    """Start the server (once per process; later calls find it running), importing `modules`
    and what every worker needs: torch's launcher and torch._dynamo, which torch.optim imports
    when the first optimizer is built (0.7 s a worker)."""
    worker_environment(threads)
    multiprocessing.set_forkserver_preload([__name__, *modules, LAUNCHER, "torch._dynamo"])
    os.environ[SERVER] = str(os.getpid())  # for the server alone: no other child may see it
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        del os.environ[SERVER]
