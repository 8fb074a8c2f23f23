"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
al. 2022) over the `tp` axis, applied in place to a plain `plait.model.Transformer`.

Each block half is a column-parallel layer followed by a row-parallel one:

    attention:    wq, wk, wv split by heads (output rows)  ->  wo split by heads (input columns)
    feed-forward: w1, w3 split by hidden units (rows)      ->  w2 split by hidden units (columns)

so the half needs exactly one collective on the way in and one on the way out, placed by module
hooks around `attention` and `feed_forward` (names and call signatures stay the model's own):

    without SP: in f = copy (all-reduce in backward), out g = all-reduce
    with SP:    in  = all-gather along the sequence, out = reduce-scatter along the sequence

Under sequence parallelism the residual stream, the norms and the dropout-free elementwise work
hold (batch, seq / T, dim): activation memory of those regions divided by T for the same bytes
communicated. The norms then see a shard of the tokens, so their weight gradients are partial sums
and are all-reduced over `tp` as they arrive.

The embedding and the output head are split by vocabulary (`vocab_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from plait.comm import all_reduced
from plait.comm.autograd import (
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from plait.model.llama import RMSNorm, Transformer
from plait.parallel.vocab_parallel import VocabParallelEmbedding

# (module path inside a block, dim of nn.Linear.weight that is split): 0 = output rows
# (column-parallel), 1 = input columns (row-parallel).
BLOCK_SPLITS = {
    "attention.wq": 0, "attention.wk": 0, "attention.wv": 0, "attention.wo": 1,
    "feed_forward.w1": 0, "feed_forward.w3": 0, "feed_forward.w2": 1,
}


@dataclass
class TensorParallelPlan:
    """What `apply_tp` did: the parameters it split (each rank holds 1/T of them) and those it left
    whole on every rank."""

    sharded: set[str] = field(default_factory=set)
    replicated: set[str] = field(default_factory=set)


def _split_linear(linear: nn.Linear, dim: int, rank: int, size: int) -> None:
    """Keep this rank's 1/size of the weight along `dim`, in place."""
    chunk = linear.weight.detach().chunk(size, dim=dim)[rank].clone()
    linear.weight = nn.Parameter(chunk)
    linear.out_features, linear.in_features = chunk.shape


def _wrap_half(module: nn.Module, group: ProcessGroup, sequence_parallel: bool) -> None:
    """One collective into the block half (its first argument) and one out of it."""
    enter = gather_from_sp if sequence_parallel else copy_to_tp
    leave = reduce_scatter_to_sp if sequence_parallel else reduce_from_tp
    module.register_forward_pre_hook(lambda mod, args: (enter(args[0], group), *args[1:]))
    module.register_forward_hook(lambda mod, args, out: leave(out, group))


def apply_tp(model: Transformer, group: ProcessGroup, sequence_parallel: bool = False):
    """Split `model` across the ranks of `group` in place; returns the plan."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    args = model.args
    for what, count in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads),
                        ("ffn_dim", args.ffn_dim), ("vocab_size", args.vocab_size)):
        if count % size:
            raise ValueError(f"tp={size} must divide {what}={count}")
    plan = TensorParallelPlan()
    if size == 1:
        plan.replicated = {n for n, _ in model.named_parameters()}
        return plan
    for block in model.layers.values():
        for path, dim in BLOCK_SPLITS.items():
            _split_linear(block.get_submodule(path), dim, rank, size)
        _wrap_half(block.attention, group, sequence_parallel)
        _wrap_half(block.feed_forward, group, sequence_parallel)
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, group, sequence_parallel)
    _split_linear(model.output, 0, rank, size)  # column-parallel head: logits (b, s, V / T)
    enter = gather_from_sp if sequence_parallel else copy_to_tp
    model.output.register_forward_pre_hook(lambda mod, a: (enter(a[0], group),))
    if sequence_parallel:
        for norm in (m for m in model.modules() if isinstance(m, RMSNorm)):
            norm.weight.register_hook(lambda grad: all_reduced(grad, group))
    plan.sharded = {f"layers.{i}.{path}.weight" for i in model.layers for path in BLOCK_SPLITS}
    plan.sharded |= {"tok_embeddings.weight", "output.weight"}
    plan.replicated = {n for n, _ in model.named_parameters()} - plan.sharded
    _verify(model, plan, size)
    return plan


def _verify(model: Transformer, plan: TensorParallelPlan, size: int) -> None:
    """Check that the transform happened: every split weight has 1/T of its full shape, the
    embedding was replaced, and every block half communicates."""
    args = model.args
    full = {
        "attention.wq": (args.n_heads * args.head_dim, args.dim),
        "attention.wk": (args.n_kv_heads * args.head_dim, args.dim),
        "attention.wv": (args.n_kv_heads * args.head_dim, args.dim),
        "attention.wo": (args.dim, args.n_heads * args.head_dim),
        "feed_forward.w1": (args.ffn_dim, args.dim),
        "feed_forward.w3": (args.ffn_dim, args.dim),
        "feed_forward.w2": (args.dim, args.ffn_dim),
    }
    params = dict(model.named_parameters())
    for i, block in model.layers.items():
        for path, dim in BLOCK_SPLITS.items():
            want = list(full[path])
            want[dim] //= size
            got = tuple(params[f"layers.{i}.{path}.weight"].shape)
            if got != tuple(want):
                raise RuntimeError(f"layers.{i}.{path} was not split: {got}, expected {want}")
        for half in (block.attention, block.feed_forward):
            if not (half._forward_pre_hooks and half._forward_hooks):
                raise RuntimeError(f"layers.{i}: a block half has no tensor-parallel collectives")
    if not isinstance(model.tok_embeddings, VocabParallelEmbedding):
        raise RuntimeError("tok_embeddings was not made vocabulary-parallel")
    if params["output.weight"].shape != (args.vocab_size // size, args.dim):
        raise RuntimeError("output was not split by vocabulary")
    if plan.sharded - params.keys():
        raise RuntimeError(f"planned shards missing: {sorted(plan.sharded - params.keys())}")


def grad_norm_sq(model: nn.Module, plan: TensorParallelPlan, group: ProcessGroup) -> torch.Tensor:
    """Squared global gradient norm: the shards' squares summed over `tp`, replicated parameters'
    counted once (they are equal on every tp rank)."""
    sharded, replicated = [], []
    for name, p in model.named_parameters():
        if p.grad is not None:
            sq = p.grad.detach().double().pow(2).sum()
            (sharded if name in plan.sharded else replicated).append(sq)
    zero = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    total_sharded = all_reduced(torch.stack(sharded).sum(), group) if sharded else zero
    return total_sharded + (torch.stack(replicated).sum() if replicated else zero)
