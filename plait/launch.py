"""Start N local workers through torch.distributed's elastic launcher (what `torchrun` uses).

A worker that raises brings the whole job down: the agent stops the other workers and the
launcher raises `ChildFailedError` carrying the failed worker's traceback.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def in_torchrun() -> bool:
    """True inside a worker started by torchrun (or by `launch`)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE"} <= os.environ.keys()


def launch(nproc: int, entrypoint: Callable, *args, threads: int = 1) -> list:
    """Run `entrypoint(*args)` on `nproc` local workers over loopback; their return values by rank.

    `entrypoint` must be a module-level function (workers are spawned, so it is pickled by name),
    decorated with `torch.distributed.elastic.multiprocessing.errors.record` so that a failure
    reaches the launcher with its traceback."""
    # The agent's INFO/WARNING chatter (rendezvous, OMP defaults) is noise for a local run.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if sys.platform.startswith("linux"):
        # Gloo otherwise picks the interface the hostname resolves to, which may not be loopback.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # The agent keeps per-run logs and error files in a folder; ours is removed afterwards (the
    # failed worker's traceback is read into the exception before).
    with tempfile.TemporaryDirectory(prefix="plait-launch-") as logs:
        config = _config(nproc, logs)
        results = elastic_launch(config, entrypoint)(*args)
    return [results[r] for r in sorted(results)]


def _config(nproc: int, logs: str) -> LaunchConfig:
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"plait-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=logs),
    )


__all__ = ["ChildFailedError", "in_torchrun", "launch"]
