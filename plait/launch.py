"""Start N local workers through torch.distributed's elastic launcher (what `torchrun` uses).

A worker that raises brings the whole job down: the agent stops the other workers and the
launcher raises `ChildFailedError` carrying the failed worker's traceback. When one worker's
failure makes others fail too (their peer's connection closed), torch's agent reports whichever
failed worker it polls first; plait reports the first to fail as the cause, with the others as
"other failures": a worker that raised by its error file's time, and a worker that ended without
raising (SIGKILL, the kernel's out-of-memory killer, a crash: no error file, and its exit status
is its parent's, the forkserver's) by the time the launcher saw its process end (`_Ends`: each
worker leaves its pid beside its error file, the launcher waits on a pidfd of each).

Workers are forked from a forkserver that imported torch and the entrypoint's module once, not
spawned: a spawned worker imports torch again (~3 s of CPU each, 8 workers on 2 cores: ~20 s).
`plait train` starts that server before it imports torch itself (`plait/forkserver.py`).

Everything listens on loopback. torch's `TCPStore` server binds every interface whatever host it
is given, so the local rendezvous (`plait-loopback`, torch's dynamic c10d rendezvous) hands its
two stores (the rendezvous state, and the one the workers bootstrap from at MASTER_ADDR, new for
each restart of the workers) a socket plait bound to 127.0.0.1 (`master_listen_fd`). The workers'
gloo connections use the loopback interface (GLOO_SOCKET_IFNAME=lo).
"""

from __future__ import annotations

import importlib
import logging
import os
import runpy
import select
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
    record,
)
from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from plait import forkserver

LOOPBACK = "127.0.0.1"


def loopback_store(timeout_s: float = 300.0) -> dist.TCPStore:
    """A TCPStore server listening on 127.0.0.1 alone."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen()
    port = sock.getsockname()[1]
    return dist.TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach())


class _LoopbackRendezvous(DynamicRendezvousHandler):
    """torch's dynamic rendezvous, whose store for the workers listens on loopback only."""

    def _create_tcp_store_server(self, master_addr, master_port) -> dist.TCPStore:
        return loopback_store()

    def get_backend(self) -> str:
        return "plait-loopback"

    def next_rendezvous(self):
        """Each round (each restart of the workers) gets a fresh store for the workers: torch
        would keep the first, whose keys from the dead attempt (the old process group's
        addresses) the new workers would read and hang on."""
        self._shared_tcp_store_server = self._bootstrap_store_info = None
        return super().next_rendezvous()


def _loopback_rendezvous(params: RendezvousParameters) -> DynamicRendezvousHandler:
    store = loopback_store(timeout_s=60)
    backend = C10dRendezvousBackend(store, params.run_id)
    return _LoopbackRendezvous.from_backend(params.run_id, store, backend, params.min_nodes,
                                            params.max_nodes, local_addr=LOOPBACK)


rendezvous_handler_registry.register("plait-loopback", _loopback_rendezvous)


@record
def _run_script(script: str, args: list[str]) -> None:
    """A worker of `launch_script`: the script as `python script args...` would run it."""
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # sys.exit(0) (argparse's --help, say) is a normal end
        if e.code not in (None, 0):
            raise


def launch_script(nproc: int, script: str, args: Sequence[str] = (), threads: int = 1,
                  preload: Sequence[str] = ()) -> None:
    """`python script args...` on `nproc` local workers, as torchrun would start it (RANK,
    WORLD_SIZE, MASTER_ADDR, ... set; `plait.init()` reads them), over loopback. Each worker is
    forked from the launcher's forkserver, which imported torch and plait's API once, and runs
    the script as its `__main__` (`preload`: more modules it imports once for all of them).
    Their output goes to this terminal; a worker that fails brings the others down
    (`ChildFailedError`, with its traceback)."""
    launch(nproc, _run_script, script, list(args), threads=threads,
           preload=("plait.api", *preload))


def launch(nproc: int, entrypoint: Callable | str, *args, threads: int = 1,
           max_restarts: int = 0, preload: Sequence[str] = ()) -> list:
    """Run `entrypoint(*args)` on `nproc` local workers over loopback; their return values by rank.

    `entrypoint` must be a module-level function (it is pickled by name for the workers)
    decorated with `torch.distributed.elastic.multiprocessing.errors.record`, so that a failure
    reaches the launcher with its traceback; or its name, "module:function", which this process
    then never imports (the training stack is 2 s of imports a launcher does not need). With
    `max_restarts`, the agent restarts all the workers (up to that many times) when one fails;
    the error is raised after the last.
    `preload`: more modules the workers will import, imported once by the forkserver (the
    entrypoint's own module always is)."""
    # The agent's INFO/WARNING chatter (rendezvous, OMP defaults) is noise for a local run, and
    # its log of a failed worker's traceback is said again, shorter, by `report`.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # Workers are forked from one server process that imported torch and the entrypoint's module
    # once (a fresh interpreter, started before any worker, so no lock of the launcher's threads
    # is inherited): each spawned worker would import them again, ~3 s of CPU each. Already
    # running when the caller started it early (`plait.forkserver`).
    module = entrypoint.partition(":")[0] if isinstance(entrypoint, str) else entrypoint.__module__
    forkserver.start([module, *preload], threads)
    # The agent keeps per-run logs and error files in a folder; ours is removed afterwards (the
    # failed worker's traceback is read into the exception before).
    with tempfile.TemporaryDirectory(prefix="plait-launch-") as logs:
        config = _config(nproc, logs, max_restarts)
        ends = _Ends(Path(logs))
        ends.start()
        try:
            results = elastic_launch(config, _worker)(entrypoint, *args)
        except ChildFailedError as e:
            raise _with_root_cause(e, Path(logs), ends.stop()) from None
        finally:
            ends.stop()  # whatever ended the launch (stopping twice is harmless)
    return [results[r] for r in sorted(results)]


def _worker(entrypoint: Callable | str, *args):
    """A worker: its pid beside its error file (for `_Ends`), the entrypoint (imported by the
    forkserver where it is named), and a mark that it returned (so that its end is not taken
    for a silent death)."""
    if isinstance(entrypoint, str):
        module, _, name = entrypoint.partition(":")
        entrypoint = getattr(importlib.import_module(module), name)
    here = Path(os.environ["TORCHELASTIC_ERROR_FILE"]).parent
    here.mkdir(parents=True, exist_ok=True)
    (here / "pid.tmp").write_text(str(os.getpid()))
    (here / "pid.tmp").rename(here / "pid")  # whole, never read half-written
    result = entrypoint(*args)
    (here / "returned").touch()
    return result


class _Ends(threading.Thread):
    """Watches the workers' processes (a pidfd each, as their pid files appear under `logs`) and
    records when each ended, in wall-clock nanoseconds, as the error files' times are."""

    def __init__(self, logs: Path):
        super().__init__(daemon=True)
        self.logs, self.ended, self._done = logs, {}, threading.Event()

    def run(self) -> None:
        poller, fds, seen = select.poll(), {}, set()
        while not self._done.is_set():
            for f in set(self.logs.glob("*/attempt_*/*/pid")) - seen:
                seen.add(f)
                try:
                    fd = os.pidfd_open(int(f.read_text()))
                except ProcessLookupError:  # ended before it was watched: soon after its start
                    self.ended[f.parent] = f.stat().st_mtime_ns
                    continue
                fds[fd] = f.parent
                poller.register(fd, select.POLLIN)
            ready = poller.poll(50)
            now = time.time_ns()  # one time for all seen at once: their order is unknown
            for fd, _ in ready:
                self.ended[fds.pop(fd)] = now
                poller.unregister(fd)
                os.close(fd)
        for fd in fds:
            os.close(fd)

    def stop(self) -> dict[Path, int]:
        self._done.set()
        self.join()
        return self.ended


class _EndedSilently(ProcessFailure):
    """A worker that ended without raising: no traceback, no error file, and an exit status only
    its parent (the forkserver) saw."""

    def __post_init__(self):
        self._set_no_reply_file()
        self.message = ("ended without a traceback before any other rank failed: killed by a "
                        "signal (SIGKILL, the kernel's out-of-memory killer) or crashed")

    def signal_name(self) -> str:
        return "<N/A>"


def _with_root_cause(error: ChildFailedError, logs: Path,
                     ended: dict[Path, int]) -> ChildFailedError:
    """`error` with every failed worker of the last attempt, the first to fail first. torch keeps
    only the worker it polled first, and picks a root cause by a timestamp in whole seconds (ties
    go to the first listed). The workers' folders are logs/<run>/attempt_<n>/<local rank>/ (one
    node, so the local rank is the rank): one that raised has its error.json, ordered by its
    time; one that ended (`ended`) without an error file or returning died silently, and caused
    the rest where it ended before the first error file was written or before the worker that
    wrote it ended, as `_Ends` saw them (those after were stopped by the agent, which stops them
    only once it has seen a worker end). The second test is the one that holds on a loaded
    machine: a killed worker's sockets close before the kernel wakes the watcher, and its peer
    may write its error in between; it cannot also end before the killed one is seen ended. (A
    stopped worker ends a poll of the agent's, up to `monitor_interval`, after the first raiser:
    only a watcher asleep through both would count it a cause.)"""
    attempts = sorted(logs.glob("*/attempt_*"), key=lambda d: int(d.name.split("_")[1]))
    folders = sorted(attempts[-1].iterdir()) if attempts else []
    raised = {d: (d / "error.json").stat().st_mtime_ns for d in folders
              if (d / "error.json").is_file()}
    first = min(raised, key=raised.get, default=None)

    def caused(d: Path, t: int) -> bool:
        return first is None or t < raised[first] or t <= ended.get(first, -1)

    silent = {d: t for d, t in ended.items() if d in folders and d not in raised
              and not (d / "returned").exists() and caused(d, t)}
    failures = {}
    for d, t in sorted(silent.items(), key=lambda item: item[1]):
        rank = int(d.name)  # torch's record where it polled that worker (its exit status), or ours
        failures[rank] = error.failures.get(rank) or \
            _EndedSilently(rank, int((d / "pid").read_text()), "?", "<N/A>")
        failures[rank].timestamp = min(t, raised.get(first, t)) // 10**9  # first, as it was
    for d in sorted(raised, key=raised.get):  # pid unknown (-1) unless torch polled that worker
        rank = int(d.name)
        failures[rank] = error.failures.get(rank) or ProcessFailure(rank, -1, 1,
                                                                     str(d / "error.json"))
    for rank, failure in error.failures.items():  # one torch saw and we did not
        failures.setdefault(rank, failure)
    return ChildFailedError(error.name, failures)


def report(error: ChildFailedError, kept: str = "") -> str:
    """A failed job in a few lines: the first worker to fail with its error and where it was
    raised, the others one line each (an error the first one shares said once), what was kept
    (`kept`), and a file holding every worker's whole traceback (torch's `format_msg`), named.
    The others mostly fail because the first did (a closed connection, the same refusal)."""
    log = Path(tempfile.gettempdir()) / f"plait-failure-{time.strftime('%Y%m%d-%H%M%S')}-" \
        f"{os.getpid()}.log"
    try:
        log.write_text(error.format_msg() + "\n")
    except OSError as e:  # nowhere to keep them: every traceback here, as torch prints them
        return f"{error.format_msg()}\nplait: (no log file: {e.strerror or e})"
    first, failure = error.get_first_failure()
    said, where = _said(failure)
    lines = [f"plait: the job failed: rank {first} first{where}:",
             *(f"  {line}" for line in said.splitlines()[:REPORTED_LINES])]
    others: dict[str, list[int]] = {}
    for rank, other in error.failures.items():
        if rank != first:
            others.setdefault(_said(other)[0], []).append(rank)
    for message, ranks in list(others.items())[:REPORTED_OTHERS]:
        which = f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"
        lines.append(f"plait: {which} failed too, " + (
            "with the same error" if message == said else
            f"then: {message.splitlines()[-1][:200] if message else 'no message'}"))
    if len(others) > REPORTED_OTHERS:
        lines.append(f"plait: and {len(others) - REPORTED_OTHERS} other error(s) (in the log)")
    if kept:
        lines.append(f"plait: {kept}")
    lines.append(f"plait: every rank's traceback: {log}")
    return "\n".join(lines)


REPORTED_LINES = 8  # of the first failure's message
REPORTED_OTHERS = 3  # distinct errors of the other workers, a line each


def _said(failure: ProcessFailure) -> tuple[str, str]:
    """(a worker's error, " at FILE:LINE (function)" where its traceback says where it was
    raised, else ""), from its error file as torch's `record` writes it."""
    data = failure.error_file_data.get("message")
    if not isinstance(data, dict):
        return str(failure.message).strip(), ""
    frames = [line.strip() for line in data.get("extraInfo", {}).get("py_callstack", "")
              .splitlines() if line.strip().startswith('File "')]
    where = ""
    if frames:  # File "/.../plait/train/checkpointing.py", line 146, in _refusal_said
        path, _, rest = frames[-1][len('File "'):].partition('", line ')
        line, _, function = rest.partition(", in ")
        inside = path.rsplit("/plait/", 1)
        short = f"plait/{inside[1]}" if len(inside) == 2 else path
        where = f" at {short}:{line} ({function})"
    return str(data.get("message", failure.message)).strip(), where


def _config(nproc: int, logs: str, max_restarts: int = 0) -> LaunchConfig:
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"plait-{uuid.uuid4().hex[:8]}",
        rdzv_backend="plait-loopback",
        rdzv_endpoint=f"{LOOPBACK}:0",
        local_addr=LOOPBACK,
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="forkserver",
        logs_specs=DefaultLogsSpecs(log_dir=logs),
    )


__all__ = ["ChildFailedError", "launch", "launch_script", "report"]
