"""Module-level worker functions for tests that go through the elastic launcher (spawned workers
find their function by name, so it cannot live inside a test)."""

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from plait.comm import all_reduce


@record
def rank_one_fails():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise RuntimeError("rank one fails on purpose")
    all_reduce(torch.ones(1), dist.group.WORLD)  # rank 0 would wait here forever


@record
def world_sum():
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    all_reduce(t, dist.group.WORLD)
    dist.destroy_process_group()
    return t.item()


@record
def rank_one_is_killed():
    """Rank 1 dies by SIGKILL (no traceback, no error file); rank 0, in a collective with it,
    fails on the closed connection and writes one: the killed rank is still the cause."""
    import os
    import signal
    import time

    dist.init_process_group("gloo")
    all_reduce(torch.ones(1), dist.group.WORLD)  # both connected
    if dist.get_rank() == 1:
        time.sleep(0.3)  # the launcher watches it by now
        os.kill(os.getpid(), signal.SIGKILL)
    all_reduce(torch.ones(1), dist.group.WORLD)
