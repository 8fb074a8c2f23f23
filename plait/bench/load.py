"""What else ran on the machine while a bench measured: other processes' CPU time, from /proc.

A ratio of two timings taken while other jobs compete for the cores can say anything (a ZeRO-1
ratio of 0.67 was measured so). `OtherLoad` samples every process's CPU time (utime + stime in
/proc/PID/stat) twice a second: the bench's own processes are this one and its descendants (the
launcher's workers, its forkserver); the machine's busy time comes from /proc/stat. What the
others used is the machine's busy time less the bench's, as a share of all cores over the
wall time. A row measured above `BUSY` is marked, and the bench says which.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

BUSY = 0.10  # other processes' share of the cores above which a timing is marked
TICK = os.sysconf("SC_CLK_TCK")


def _machine_busy() -> float:
    """Seconds of CPU time spent busy by all cores since boot (/proc/stat's first line: all but
    idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICK


def _processes() -> dict[int, tuple[int, float]]:
    """pid -> (its parent's pid, its CPU seconds so far), every process readable now."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:  # gone since the listing
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
        out[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK)
    return out


def _ours(procs: dict[int, tuple[int, float]], root: int) -> set[int]:
    """`root` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in procs.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return found


class OtherLoad:
    """`with OtherLoad() as load: ...` then `load.share`: the other processes' share of the
    machine's cores during the block (0 on a quiet machine, 1: every core busy elsewhere)."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.share, self.ours_s, self.others_s = every_s, 0.0, 0.0, 0.0
        self._stop = threading.Event()

    def __enter__(self) -> OtherLoad:
        self._seen: dict[int, float] = {}  # our processes' CPU seconds at their first sample
        self._last: dict[int, float] = {}  # ... and at their latest
        self._sample(first=True)
        self._start, self._busy = time.perf_counter(), _machine_busy()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def _sample(self, first: bool = False) -> None:
        procs = _processes()
        for pid in _ours(procs, os.getpid()):
            cpu = procs[pid][1]
            self._seen.setdefault(pid, cpu if first else 0.0)  # born since: counted from 0
            self._last[pid] = cpu

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        wall = time.perf_counter() - self._start
        # CPU seconds during the block: ours (a process of ours that ended between two samples
        # loses what it used after the last one to the others) and everyone else's.
        self.ours_s = sum(self._last[pid] - self._seen[pid] for pid in self._last)
        self.others_s = max(0.0, _machine_busy() - self._busy - self.ours_s)
        self.share = self.others_s / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0
