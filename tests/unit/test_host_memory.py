"""The trainer's glibc policy (`plait/host_memory.py`), in processes of their own: mallopt
settings are process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A step's activations at the heap's top (16 MiB, under the 32 MiB threshold: from the heap),
# written, then freed, three times: the page faults of the last two. glibc's own malloc (as
# torch's CPU allocator calls it), without torch: the policy is glibc's.
STEPS = """
import ctypes, resource, sys
from plait.host_memory import release_freed_memory
assert release_freed_memory(int(sys.argv[1]))
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

def step():
    block = libc.malloc(16 << 20)
    libc.memset(block, 1, 16 << 20)
    libc.free(block)

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

PAGES = 2 * 16 * 2**20 // 4096  # two steps' blocks


def _later_steps_faults(threshold: int) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS, str(threshold)], capture_output=True,
                         text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_steady_step_reuses_the_pages_the_last_one_freed():
    """From the second step on, what a step frees stays in the heap for the next: its pages are
    not faulted in again (a threshold set by hand left glibc's trim threshold at 128
    KiB, and the freed top of the heap went back to the kernel each step: 6% of the default
    recipe's step at 2 ranks). While the model is built (1 MiB threshold) what is freed goes
    back: the same blocks are faulted in again."""
    from plait.host_memory import STEADY_THRESHOLD, THRESHOLD

    assert _later_steps_faults(STEADY_THRESHOLD) < PAGES // 20
    assert _later_steps_faults(THRESHOLD) > PAGES // 2


# 96 MiB of blocks under the threshold, written, then every other one freed (what a build frees
# between what it keeps): 48 MiB of holes in the heap's middle, which glibc's trim of the top
# does not reach, resident until `give_back_freed`.
HOLES = """
import ctypes
from plait.host_memory import anonymous_bytes, give_back_freed, release_freed_memory
assert release_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
blocks = [libc.malloc(64 << 10) for _ in range(2 * 768)]
for b in blocks:
    libc.memset(b, 1, 64 << 10)
for b in blocks[::2]:
    libc.free(b)
resident = anonymous_bytes()
assert give_back_freed()
print(resident - anonymous_bytes())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_blocks_pinned_under_a_live_one_go_back_to_the_kernel():
    """The pages ZeRO-3's build frees below a block it keeps (`give_back_freed` after each unit):
    nearly all of the 48 MiB leave the process's resident memory."""
    out = subprocess.run([sys.executable, "-c", HOLES], capture_output=True, text=True,
                         check=True)
    assert int(out.stdout) > 40 * 2**20
