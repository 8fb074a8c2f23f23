"""Differentiable collectives: the conjugate pairs of tensor and sequence parallelism.

Megatron-LM (Shoeybi et al. 2019, section 3) calls the first pair f and g: around a
column-parallel layer followed by a row-parallel one, f copies the replicated input in and g sums
the partial outputs; each one's backward is the other's forward. Sequence parallelism
(Korthikanti et al. 2022, section 4.2.2) splits g into a reduce-scatter along the sequence and f
into an all-gather, so the activations between block halves are held 1/T per rank.

Tensors are (batch, seq, ...) and the sequence is dim 1; gathered and scattered chunks are in
rank order. All communication goes through the accounted collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from plait.comm.collectives import all_gather, all_reduced, reduce_scatter


def _gather_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(b, s / T, ...) on each rank -> (b, s, ...), rank r's chunk at [r * s / T, ...)."""
    n = dist.get_world_size(group)
    local = x.transpose(0, 1).contiguous()  # (s / T, b, ...): gathering along dim 0
    out = local.new_empty((n * local.shape[0], *local.shape[1:]))
    all_gather(out, local, group)
    # Contiguous once here: a transposed view would make every matmul that reads it (q, k, v;
    # w1, w3) save a contiguous copy of its own for backward.
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(b, s, ...) partial sums on each rank -> this rank's (b, s / T, ...) of the total."""
    n = dist.get_world_size(group)
    full = x.transpose(0, 1).contiguous()  # (s, b, ...)
    out = full.new_empty((full.shape[0] // n, *full.shape[1:]))
    reduce_scatter(out, full, group)
    return out.transpose(0, 1)


class CopyToTensorParallel(torch.autograd.Function):
    """f. Forward: identity (the input is already replicated). Backward: all-reduce, summing the
    gradients that each rank's column shard sent back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduced(grad, ctx.group), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g. Forward: all-reduce of the row shards' partial outputs. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduced(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSequenceParallel(torch.autograd.Function):
    """f under sequence parallelism. Forward: all-gather the sequence shards. Backward:
    reduce-scatter, each rank keeping the summed gradient of its own shard."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """g under sequence parallelism. Forward: reduce-scatter the partial outputs along the
    sequence. Backward: all-gather the shards' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return ReduceFromTensorParallel.apply(x, group)


def gather_from_sp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return GatherFromSequenceParallel.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return ReduceScatterToSequenceParallel.apply(x, group)
