"""The diagnosis of a timed-out collective names the late ranks from their heartbeats."""

import json
import time

from plait.comm import watchdog


class FakeStore(dict):
    def set(self, key, value):
        self[key] = value.encode()

    def check(self, keys):
        return all(k in self for k in keys)

    def get(self, key):
        return self[key]


def test_a_rank_behind_and_a_stopped_rank_are_named(monkeypatch):
    recorder = watchdog.FlightRecorder()
    monkeypatch.setattr(watchdog, "RECORDER", recorder)
    group = (0, 1, 2)
    recorder.counts[group] = 7
    recorder.entries.append(watchdog.Entry(7, "all_reduce", group, 64, time.time()))
    store, now = FakeStore(), time.time()
    beat = lambda count, age: json.dumps(  # noqa: E731
        {"time": now - age, "last": f"all_reduce #{count}", "counts": [[list(group), count]]})
    store.set("plait/beat/0", beat(7, 0.1))
    store.set("plait/beat/1", beat(6, 0.5))  # alive, one collective behind
    store.set("plait/beat/2", beat(7, 30.0))  # silent for 30 s
    message = watchdog.diagnose(store, 3, interval=1.0, timeout_s=10)
    assert message.startswith("all_reduce #7 on ranks [0, 1, 2] (64 B) did not complete within "
                              "parallel.timeout_s=10 s")
    assert "1 (alive, but issued 6 collective(s) on this group" in message
    assert "2 (stopped answering: its last heartbeat is 30 s old; it had issued #7 too" in message
    assert "0 (" not in message.split("did not arrive:")[1].split(";")[0]
    assert "per rank: 0: 7, 1: 6, 2: 7" in message


def test_timeouts_are_recognised():
    assert watchdog.is_timeout(RuntimeError("Timed out waiting 5000ms for recv operation"))
    assert not watchdog.is_timeout(RuntimeError("Connection closed by peer"))


def test_a_rank_stopped_before_its_first_heartbeat_is_credited_with_what_it_joined(monkeypatch):
    """Its only heartbeat (at its start) counted nothing; the waiting rank completed 11
    collectives of the group with it, so it joined those."""
    recorder = watchdog.FlightRecorder()
    monkeypatch.setattr(watchdog, "RECORDER", recorder)
    group = (0, 1)
    recorder.counts[group] = 12
    recorder.entries.append(watchdog.Entry(12, "all_reduce", group, 8, time.time()))
    store, now = FakeStore(), time.time()
    store.set("plait/beat/0", json.dumps({"time": now - 6, "last": None, "counts": []}))
    store.set("plait/beat/1", json.dumps({"time": now, "last": "all_reduce #12",
                                          "counts": [[list(group), 12]]}))
    message = watchdog.diagnose(store, 2, interval=1.0, timeout_s=5)
    assert "0 (stopped answering: its last heartbeat is 6 s old; it joined this group's " \
           "collectives up to #11 and not #12)" in message
    assert "per rank: 0: 11, 1: 12" in message
