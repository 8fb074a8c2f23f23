"""A stuck rank is named, not waited for: a flight recorder of each rank's recent collectives, a
heartbeat each rank publishes, and the diagnosis made when a collective times out.

- `RECORDER` (process-wide, like the ledger) keeps the last collectives this rank issued and how
  many it has issued on each group.
- `Heartbeat` publishes, every `interval` seconds from a thread, this rank's per-group counts,
  its last collective and the time to a key-value store shared by the job (the launcher's).
- When a collective does not complete within `parallel.timeout_s` (the process group's timeout),
  the rank that waited calls `diagnose`: the ranks of the group that did not arrive are those
  whose count on that group is behind, or whose heartbeat stopped (a stopped or hung process
  publishes nothing). The message names them, the collective, its group, each rank's count, and
  this rank's flight recorder.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Entry:
    seq: int  # this collective's number on its group, from this rank's side (1-based)
    op: str
    ranks: tuple[int, ...]  # the group's global ranks
    nbytes: int
    time: float

    def __str__(self) -> str:
        return f"{self.op} #{self.seq} on ranks {list(self.ranks)} ({self.nbytes:,} B)"


class FlightRecorder:
    def __init__(self, size: int = 16):
        self.entries: deque[Entry] = deque(maxlen=size)
        self.counts: Counter = Counter()  # group ranks -> collectives issued on it
        self._ranks: dict[int, tuple[int, ...]] = {}

    def record(self, op: str, group, nbytes: int) -> Entry:
        ranks = self._ranks.get(id(group))
        if ranks is None:
            ranks = self._ranks[id(group)] = tuple(dist.get_process_group_ranks(group))
        self.counts[ranks] += 1
        entry = Entry(self.counts[ranks], op, ranks, nbytes, time.time())
        self.entries.append(entry)
        return entry

    def dump(self) -> str:
        return "; ".join(str(e) for e in self.entries) or "none"


RECORDER = FlightRecorder()


class Heartbeat:
    """Publishes this rank's state every `interval` seconds under plait/beat/<rank>."""

    def __init__(self, store, rank: int, interval: float):
        self.store, self.rank, self.interval = store, rank, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="plait-heartbeat")

    def start(self) -> Heartbeat:
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        last = RECORDER.entries[-1] if RECORDER.entries else None
        state = {"time": time.time(), "last": str(last) if last else None,
                 "counts": [[list(r), c] for r, c in RECORDER.counts.items()]}
        self.store.set(f"plait/beat/{self.rank}", json.dumps(state))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # the store is gone: the job is ending
                return


def is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def diagnose(store, world_size: int, interval: float, timeout_s: float) -> str:
    """One message: the collective this rank waited on, the ranks of its group that did not
    arrive, every rank's count on that group, and this rank's flight recorder."""
    waited = RECORDER.entries[-1] if RECORDER.entries else None
    now, beats = time.time(), {}
    for rank in range(world_size):
        key = f"plait/beat/{rank}"
        if store.check([key]):
            beats[rank] = json.loads(store.get(key))
    if waited is None:
        return f"a collective did not complete within parallel.timeout_s={timeout_s:g} s"
    # This rank completed the group's collectives before this one, which every rank of the
    # group joined: each issued at least seq - 1, whatever its last heartbeat had time to say.
    joined = waited.seq - 1
    late, counts = [], []
    for rank in waited.ranks:
        beat = beats.get(rank)
        if beat is None:
            late.append(f"{rank} (never reported)")
            continue
        reported = dict((tuple(r), c) for r, c in beat["counts"]).get(waited.ranks, 0)
        count, age = max(joined, reported), now - beat["time"]
        counts.append(f"{rank}: {count}")
        if age > 3 * interval:
            where = (f"it had issued #{waited.seq} too" if count >= waited.seq else
                     f"it joined this group's collectives up to #{count} and not #{waited.seq}")
            late.append(f"{rank} (stopped answering: its last heartbeat is {age:.0f} s old; "
                        f"{where}" + (f"; its last: {beat['last']})" if reported >= joined
                                      else ")"))
        elif count < waited.seq:
            late.append(f"{rank} (alive, but issued {count} collective(s) on this group; "
                        f"its last: {beat['last']})")
    return (f"{waited} did not complete within parallel.timeout_s={timeout_s:g} s; "
            f"rank(s) that did not arrive: {', '.join(late) or 'none found'}; "
            f"collectives issued on this group per rank: {', '.join(counts)}; "
            f"this rank's last collectives: {RECORDER.dump()}")
