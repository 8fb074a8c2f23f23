"""A rank's host memory: its peak as the kernel counts it, and glibc's policy for big blocks.

glibc's malloc serves blocks above a threshold with their own `mmap`, which `free` returns to the
kernel at once; below it, from the heap, where freed memory is kept for reuse. The threshold
starts at 128 KiB and rises to the size of each such block freed (up to 32 MiB). Neither extreme
suits a training step on the CPU:

- Fresh mappings for every block of 1 MiB and more keep the peak at what is alive at once, but
  each allocation faults in zeroed pages: ZeRO-3's steps on the default recipe took 1.6 times
  fully_shard's (each gather, each activation, each gradient on fresh pages).
- The heap for everything up to 32 MiB is fast, but blocks freed between longer-lived ones stay
  resident: ZeRO-3 gathering and freeing units grew a rank of a 76M-parameter model at dp8 by
  2.3 times the whole fp32 model over three steps; FSDP2 in processes of its own (glibc's own
  policy) peaks at 4.4-4.8 times the whole fp32 model (docs/big-models.md).

So the trainer, on the CPU, fixes the threshold at 1 MiB while it builds the model and through
its first step: what lives for the run (the model's slices, optimizer state, gradient slices, DDP's
buckets) is made then, each block in a mapping of its own, out of the heap's way, and what the
build frees goes back. From the second step on it takes glibc's ceiling, 32 MiB, and turns off
glibc's fast bins (freed small chunks kept uncoalesced between the big ones: the steady peak of
`tests/dist/test_big_model.py`'s ranks reached 412 MiB in 3 runs with them, at most 362 in 3
without), so a step's blocks come from the heap and are reused; and it stops glibc trimming the
heap's top. A threshold set by hand leaves the trim threshold at 128 KiB (glibc's dynamic policy
would have raised it with the threshold), so every backward, freeing the activations at the top
of the heap, handed them back to the kernel, and the next forward faulted them in again: 10,000
page faults a step on the default recipe at 2 ranks, 6% of its time (torch's DDP, in a process of
its own under glibc's dynamic policy, took about 7,000). Untrimmed, a step reuses the pages the
last one used; what stays resident is the heap's high-water mark, which the step's peak reached
anyway (as a GPU's caching allocator keeps what it once held). What used to come and go in the
heap at the size of whole units is gone: ZeRO-3 reuses its gathered units and gradient staging
(`plait/parallel/engines/buffer_pool.py`), and gloo's own flat buffers are avoided
(`plait/comm/collectives.py`). `MALLOC_MMAP_THRESHOLD_` in the environment, glibc's own setting,
takes precedence.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

M_MXFAST = 1  # mallopt's parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
NEVER = -1  # M_TRIM_THRESHOLD's value for "never trim" (mallopt(3))
DEFAULT_TRIM = 128 << 10  # glibc's own trim threshold
THRESHOLD = 1 << 20
STEADY_THRESHOLD = 32 << 20  # glibc's own ceiling for the rising threshold


_set: list[int] = []  # the thresholds this process set, in order


def release_freed_memory(threshold: int = THRESHOLD) -> bool:
    """Serve blocks of `threshold` bytes and more by `mmap`, so that freeing them returns them to
    the kernel; at `STEADY_THRESHOLD`, without fast bins and never trimming the heap's top. False
    where the C library is not glibc or the user set glibc's variable."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
        if done and threshold == STEADY_THRESHOLD:
            libc.mallopt(M_MXFAST, 0)
            libc.mallopt(M_TRIM_THRESHOLD, NEVER)
        elif done:
            libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM)  # what is freed goes back again
    except (OSError, AttributeError):
        return False
    if done:
        _set.append(threshold)
    return done


def give_back_freed() -> bool:
    """Hand the kernel the pages of every free chunk in glibc's heaps, not only at their top
    (`malloc_trim(0)`). Building a model's slices frees many blocks below the threshold; one
    long-lived block the build then places above them pins them (seen: 15 to 45 MiB left resident
    on one rank in every two builds of `tests/dist/test_big_model.py`'s model). False where the C
    library is not glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def malloc_threshold() -> int | None:
    """The mmap threshold this process last set (`release_freed_memory`); None: glibc's own."""
    return _set[-1] if _set else None


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    return _status("VmRSS")


def anonymous_bytes() -> int:
    """This process's own resident memory (RssAnon): not the page cache of files it maps."""
    return _status("RssAnon")


def peak_resident_bytes() -> int:
    """This process's peak resident memory (VmHWM) since it started or `reset_peak`."""
    return _status("VmHWM")


def reset_peak() -> None:
    """Start the peak over from the resident memory now (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def cached_bytes(path: str | Path) -> int:
    """Bytes of the file at `path` in the page cache now (mincore over a map of it): what any
    process has read of it since it was written, or since the cache was dropped."""

    size = os.path.getsize(path)
    if not size:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap of {path}")
        try:
            pages = ctypes.create_string_buffer((size + page - 1) // page)
            if libc.mincore(addr, size, pages):
                raise OSError(ctypes.get_errno(), f"mincore of {path}")
            # Each page's byte: its lowest bit says resident (the others are reserved).
            return pages.raw.translate(bytes(b & 1 for b in range(256))).count(1) * page
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
