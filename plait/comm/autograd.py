"""Differentiable collectives: the conjugate pairs of tensor and sequence parallelism.

Megatron-LM (Shoeybi et al. 2019, section 3) calls the first pair f and g: around a
column-parallel layer followed by a row-parallel one, f copies the replicated input in and g sums
the partial outputs; each one's backward is the other's forward. Sequence parallelism
(Korthikanti et al. 2022, section 4.2.2) splits g into a reduce-scatter along the sequence and f
into an all-gather, so the activations between block halves are held 1/T per rank.

Expert parallelism adds an all-to-all of rows with uneven splits, its own conjugate; Ulysses
context parallelism (Jacobs et al. 2023) a pair of all-to-alls that trade a sequence shard of all
heads for the whole sequence of a shard of the heads, each the other's backward.

Tensors are (batch, seq, ...) and the sequence is dim 1; gathered and scattered chunks are in
rank order. All communication goes through the accounted collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from plait.comm.collectives import all_gather, all_reduced, all_to_all, reduce_scatter


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
    # (b, s / T, ...) laid out as (s / T, b, ...): the collective writes it through a contiguous
    # transposed view, and the result is no view itself, so that a layer may add to it in place
    # (Falcon's `mlp_output += attention_output`; autograd refuses that on a custom Function's
    # view output).
    layout = torch.empty((full.shape[0] // n, *full.shape[1:]), device="meta").transpose(0, 1)
    out = torch.empty_strided(layout.shape, layout.stride(), dtype=x.dtype, device=x.device)
    reduce_scatter(out.transpose(0, 1), full, group)
    return out


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


class GatherFromTensorParallel(torch.autograd.Function):
    """A column-parallel layer's output made whole (Megatron's gather_output). Forward:
    all-gather the ranks' shards along the last dim. Backward: this rank's slice of the gradient
    (every rank computed the same loss from the whole tensor, so no sum is needed)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.width = group, x.shape[-1]
        n = dist.get_world_size(group)
        local = x.movedim(-1, 0).contiguous()  # (V / T, ...): gathering along dim 0
        out = local.new_empty((n * local.shape[0], *local.shape[1:]))
        all_gather(out, local, group)
        return out.movedim(0, -1)

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        return grad.narrow(-1, rank * ctx.width, ctx.width), None


def gather_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return GatherFromTensorParallel.apply(x, group)


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return ReduceFromTensorParallel.apply(x, group)


def gather_from_sp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return GatherFromSequenceParallel.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return ReduceScatterToSequenceParallel.apply(x, group)


def _all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int],
                     group: ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    all_to_all(out, x.contiguous(), group, output_splits=recv, input_splits=send)
    return out


class AllToAll(torch.autograd.Function):
    """Rows of x, send[i] of them for rank i (in rank order), exchanged with every rank of the
    group; recv[i] rows come from rank i. Backward: the same exchange with the splits swapped,
    each gradient row going back to the rank its row came from (expert parallelism's dispatch
    and return, Lepikhin et al. 2020)."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_rows(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int],
                    group: ProcessGroup) -> torch.Tensor:
    return AllToAll.apply(x, send, recv, group)


def _seq_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(b, s / C, heads, d), sequence shard r on rank r -> (b, s, heads / C, d), head group r."""
    n = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()  # head group j -> j
    out = torch.empty_like(send)
    all_to_all(out, send, group)  # out[j]: rank j's sequence shard of this rank's head group
    return out.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def _heads_to_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The inverse: (b, s, heads / C, d), head group r -> (b, s / C, heads, d), sequence shard r."""
    n = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, n, s // n, h, d).transpose(0, 1).contiguous()  # sequence shard j -> j
    out = torch.empty_like(send)
    all_to_all(out, send, group)  # out[j]: head group j of this rank's sequence shard
    return out.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def seq_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return SeqToHeads.apply(x, group)


def heads_to_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return HeadsToSeq.apply(x, group)
