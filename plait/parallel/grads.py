"""Gradients as multi-tensor kernels take them: grouped by device and dtype, scaled in place (the
loss scale's inverse times the clipping coefficient, `Parallelized.step`)."""

from __future__ import annotations

import torch


@torch.no_grad()
def scale_grads_(params, factor: float) -> None:
    """Multiply every gradient by `factor`: the loss scale's inverse times the clipping
    coefficient. Clipping's coefficient is torch.nn.utils.clip_grad_norm_'s, max_norm / (norm +
    1e-6) capped at 1, from the global norm the caller supplies: only the parallel layout knows
    which gradients are shards to sum over ranks and which are replicas to count once."""
    for group in by_device_and_dtype([p.grad for p in params if p.grad is not None]):
        torch._foreach_mul_(group, factor)


def by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` in groups of one device and dtype: what one multi-tensor (`_foreach_*`) kernel
    takes."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())
