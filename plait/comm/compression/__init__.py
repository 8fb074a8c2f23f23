"""Gradient compression: the hook point of the data-parallel engine.

A `Compressor` turns a gradient bucket into the payload that is all-reduced (summed over the
ranks), and the reduced payload back into the bucket. The engine calls `compress` when the bucket
is full, all-reduces what it returns, and calls `decompress` before the optimizer reads the
gradients. The bucket holds this rank's gradient already divided by the number of ranks, so the
sum that comes back is the mean. Methods that need per-bucket memory (error feedback) key it by
`bucket`.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Compressor(Protocol):
    def compress(self, bucket: int, flat: torch.Tensor) -> torch.Tensor:
        """The payload to all-reduce (sum over ranks) for bucket number `bucket`."""
        ...

    def decompress(self, bucket: int, payload: torch.Tensor, out: torch.Tensor) -> None:
        """Write the reduced gradient (the mean over ranks) into `out`."""
        ...


class NoCompression:
    """The identity: the bucket itself is all-reduced."""

    def compress(self, bucket: int, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def decompress(self, bucket: int, payload: torch.Tensor, out: torch.Tensor) -> None:
        if payload.data_ptr() != out.data_ptr():
            out.copy_(payload)
