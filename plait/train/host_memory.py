"""A rank's host memory: its peak as the kernel counts it, and glibc's policy for big blocks.

glibc's malloc serves blocks above a threshold with their own `mmap`, which `free` returns to the
kernel at once; below it, from the heap, where freed memory is kept for reuse. The threshold
starts at 128 KiB and rises to the size of each such block freed (up to 32 MiB), so a ZeRO-3
rank on the CPU, which gathers and frees a unit after the other, soon serves its units from the
heap, where the gaps between longer-lived tensors keep them resident: measured on a 76M-parameter
model (dim 512, 24 blocks) at dp8, a rank's peak resident memory grew by 2.3 times the
whole fp32 model over three steps, against 0.85 times with the threshold fixed at 1 MiB, for
steps 1.8 times slower (each gather faults in fresh pages). The same holds while a rank
materializes its part of a model (`plait.model.materialize`) and lays it out in flat buckets: the
fp32 tensors it frees stay resident (a dp2 x tp2 x pp2 rank of a 304M-parameter model: 629 MiB
over its baseline, against 318 MiB with the threshold fixed).

So the trainer, on the CPU, fixes the threshold at 1 MiB while it builds the model; then ZeRO-3
keeps it (its units are freed every step), the other engines set it to 32 MiB (glibc's own
ceiling, where the rising threshold ends anyway). `MALLOC_MMAP_THRESHOLD_` in the environment,
glibc's own setting, takes precedence.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
THRESHOLD = 1 << 20
STEADY_THRESHOLD = 32 << 20  # glibc's own ceiling for the rising threshold


_set: list[int] = []  # the thresholds this process set, in order


def release_freed_memory(threshold: int = THRESHOLD) -> bool:
    """Serve blocks of `threshold` bytes and more by `mmap`, so that freeing them returns them to
    the kernel. False where the C library is not glibc or the user set glibc's variable."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
    if done:
        _set.append(threshold)
    return done


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
    import mmap

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
