"""How the bench tables write a size."""

from __future__ import annotations


def size_text(n: int) -> str:
    """`n` bytes in MiB from 1 MiB on, else in KiB."""
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.1f} KiB"
