"""Gradient buckets: parameters grouped into flat buffers of about `cap_bytes` each, so that many
small gradients travel in a few large messages (latency is paid per message).

Parameters go in reverse registration order, roughly the order backward produces their gradients,
so the first bucket fills first and its all-reduce can start while backward goes on (Li et al.
2020, "PyTorch Distributed", section 3.2.3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Bucket:
    index: int
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]  # where each parameter's gradient starts in `buffer`
    buffer: torch.Tensor  # (sum of numels,) in the gradients' dtype
    ready: set[int] = field(default_factory=set)  # positions whose gradient has arrived

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def view(self, position: int) -> torch.Tensor:
        p, start = self.params[position], self.offsets[position]
        return self.buffer[start : start + p.numel()].view_as(p)


def assign_buckets(
    named_params: list[tuple[str, nn.Parameter]], cap_bytes: int
) -> list[list[tuple[str, nn.Parameter]]]:
    """Greedy, in reverse order: a bucket is closed when the next parameter would take it past
    `cap_bytes` or has another dtype. A parameter larger than the cap gets a bucket of its own."""
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    size = 0
    for name, p in reversed(named_params):
        nbytes = p.numel() * p.element_size()
        if buckets and size + nbytes <= cap_bytes and buckets[-1][-1][1].dtype == p.dtype:
            buckets[-1].append((name, p))
            size += nbytes
        else:
            buckets.append([(name, p)])
            size = nbytes
    return buckets


def build_buckets(model: nn.Module, cap_bytes: int) -> list[Bucket]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out = []
    for index, members in enumerate(assign_buckets(named, cap_bytes)):
        offsets, total = [], 0
        for _, p in members:
            offsets.append(total)
            total += p.numel()
        buffer = torch.zeros(total, dtype=members[0][1].dtype, device=members[0][1].device)
        out.append(Bucket(index, [n for n, _ in members], [p for _, p in members], offsets, buffer))
    return out
