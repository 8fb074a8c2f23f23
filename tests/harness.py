"""Run a function on N gloo ranks from pytest.

    results = run_world(fn, 4, *args)   # fn(*args) on ranks 0..3; returns their results by rank

Workers are forked (no re-import of torch, and `fn` may be a closure), each with 1 intra-op thread,
and inherit what this process has cached: the standard library's file list, the corpus of most
tests, is listed here once (`plait.data.corpus.stdlib_files`), not by every rank, and so is each
configuration's model FLOP count (`plait.predict.trace.model_flops`). The parent holds
the rendezvous store on a free loopback port, so worlds never collide; it opens the store only after
forking, because a child forked while the store's server thread runs can inherit a lock that thread
holds, and hang. If any rank raises, the others are killed and the failing rank's traceback is
raised here; a world that outlives `timeout` is killed too. No worker outlives the call.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from plait.config.schema import Config
from plait.data.corpus import stdlib_files
from plait.predict.trace import model_flops


class WorldFailed(AssertionError):
    pass


def _worker(fn, rank, world_size, port, results, args, kwargs):
    status, payload = False, ""
    try:
        torch.set_num_threads(1)
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        while port.value == 0:  # the parent opens the store after forking us
            time.sleep(0.005)
        store = dist.TCPStore("127.0.0.1", port.value, world_size, is_master=False,
                              timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        payload = pickle.dumps(fn(*args, **kwargs))
        status = True
        dist.destroy_process_group()
    except BaseException:
        payload = traceback.format_exc()
    results.put((rank, status, payload))
    results.close()
    results.join_thread()
    os._exit(0)  # skip the atexit handlers inherited from pytest


def _count_models(args) -> None:
    """Each configuration's model FLOPs (MFU's numerator, `trace.model_flops`), counted here once
    per model: a trainer's rank 0 traced its whole model at every fit, 1-2 s of every world
    (the file list and the counts are cached, so the forked ranks read them from memory)."""
    for cfg in args:
        if isinstance(cfg, Config):
            with contextlib.suppress(Exception):  # a rank that needs it says why, as in a run
                model_flops(cfg)


def run_world(fn, world_size: int, *args, timeout: float = 120.0, **kwargs) -> list:
    stdlib_files()  # cached: the forked ranks read the corpus's file list from memory
    _count_models(args)
    ctx = mp.get_context("fork")
    results, port = ctx.Queue(), ctx.Value("i", 0)
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, results, args, kwargs),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    port.value = store.port
    out, deadline = {}, time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise WorldFailed(f"rank {dead[0]} died with exit code "
                                      f"{procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    raise WorldFailed(f"world of {world_size} timed out after {timeout:.0f} s; "
                                      f"ranks done: {sorted(out)}") from None
                continue
            if not ok:
                raise WorldFailed(f"rank {rank} of {world_size} failed:\n{payload}")
            out[rank] = pickle.loads(payload)
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        del store
