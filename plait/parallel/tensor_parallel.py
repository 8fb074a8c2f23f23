"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
al. 2022) over the `tp` axis, applied in place to a model that has a model plan
(`plait/model/plan.py`; plait's Llama: `plait/model/llama_plan.py`).

Each block half the plan names is column-parallel linears followed by row-parallel ones (the
plan's `tp_splits`; for attention, split by heads; for a feed-forward, by hidden units), so the
half needs exactly one collective on the way in and one on the way out, placed by module hooks
around it (names and call signatures stay the model's own):

    without SP: in f = copy (all-reduce in backward), out g = all-reduce
    with SP:    in  = all-gather along the sequence, out = reduce-scatter along the sequence

Under sequence parallelism the residual stream, the norms and the dropout-free elementwise work
hold (batch, seq / T, dim): activation memory of those regions divided by T for the same bytes
communicated; the column-parallel linears keep their input's shard rather than the gathered
input, and gather it again in backward (`sequence_parallel.py`). Every replicated parameter (the
norms) then sees a shard of the tokens, so its weight gradient is a partial sum and is
all-reduced over `tp` as it arrives; so is a parameter the plan lists in `tp_partial_grads` (a
mixture of experts' router), with or without SP.

The embedding and the output head are split by vocabulary (`vocab_parallel`); the head's logits
stay split for plait's vocabulary-parallel cross-entropy, and are all-gathered (`whole_logits`)
for a model that computes its own loss from them (a transformers model given `labels`).

`apply_tp` works on the whole model or on one pipeline chunk (whatever of the embedding, blocks
and head it holds), and writes the `tp` axis of each parameter into the placement record.
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from plait.comm import all_reduced
from plait.comm.autograd import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from plait.mesh import Axis
from plait.model.plan import ModelPlan, has_plan, matching, needs_plan, plan_of, tp_misfit
from plait.parallel.dropout import SplitRegionRng
from plait.parallel.placement import PlacementRecord
from plait.parallel.sequence_parallel import keep_shard, mark
from plait.parallel.vocab_parallel import VocabParallelEmbedding


def block_splits(plan: ModelPlan, block: nn.Module) -> dict[str, int]:
    """Module path inside `block` -> the dim of its weight that is split: each module whose path
    matches one of the plan's `tp_splits` patterns."""
    paths = matching((path for path, _ in block.named_modules()), plan.tp_splits)
    return {path: plan.tp_splits[pattern] for path, pattern in paths.items()}


def _blocks(chunk: nn.Module, plan: ModelPlan) -> dict[str, nn.Module]:
    return dict(chunk.get_submodule(plan.blocks).items())


def _vocab(chunk: nn.Module, plan: ModelPlan) -> list[str]:
    """The vocabulary-split modules this chunk holds."""
    return [m for m in (plan.vocab_embedding, plan.vocab_head) if m and hasattr(chunk, m)]


def _tied(chunk: nn.Module, plan: ModelPlan) -> bool:
    """Whether the chunk's input embedding and output head are one matrix (tied embeddings)."""
    vocab = _vocab(chunk, plan)
    return len(vocab) == 2 and getattr(chunk, vocab[0]).weight is getattr(chunk, vocab[1]).weight


def split_dims(chunk: nn.Module) -> dict[str, int]:
    """Parameter name -> the dim `apply_tp` splits, for the parameters of `chunk` it splits (a
    tied head's matrix is the embedding's, named once)."""
    plan = plan_of(chunk)
    out = {}
    for i, block in _blocks(chunk, plan).items():
        for path, dim in block_splits(plan, block).items():
            out[f"{plan.blocks}.{i}.{path}.weight"] = dim
            if dim == 0 and getattr(block.get_submodule(path), "bias", None) is not None:
                out[f"{plan.blocks}.{i}.{path}.bias"] = 0
        for path in plan.tp_norms:
            out[f"{plan.blocks}.{i}.{path}.weight"] = 0
    vocab = _vocab(chunk, plan)[:1] if _tied(chunk, plan) else _vocab(chunk, plan)
    return out | {f"{m}.weight": 0 for m in vocab}


def _split_linear(linear: nn.Linear, dim: int, rank: int, size: int) -> None:
    """Keep this rank's 1/size of the weight along `dim`, in place; a column-parallel linear
    (dim 0) keeps the same rows of its bias. A row-parallel one (dim 1) keeps its bias whole,
    which the sum over tp must add once (`_bias_once`)."""
    chunk = linear.weight.detach().chunk(size, dim=dim)[rank].clone()
    linear.weight = nn.Parameter(chunk)
    linear.out_features, linear.in_features = chunk.shape
    if linear.bias is not None:
        if dim == 1:
            _bias_once(linear, rank)
        else:
            linear.bias = nn.Parameter(linear.bias.detach().chunk(size)[rank].clone())


def _bias_once(linear: nn.Linear, rank: int) -> None:
    """A row-parallel linear's outputs are partial sums that the half's exit sums over tp, so
    its bias is added by tp rank 0 alone: once in the sum, as Megatron's RowParallelLinear adds
    it after the reduction. The other ranks add it times zero, so every rank's bias gets a
    gradient (rank 0's the whole one, the others' zero) that `apply_tp` sums over tp: the
    replicas stay equal, and every rank joins the sum."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        bias = linear.bias if rank == 0 else linear.bias * 0.0
        return F.linear(x, linear.weight, bias)

    linear.forward = forward


def _divide(block: nn.Module, attribute: str, size: int) -> None:
    """Divide the head count at `attribute` (dotted, block-relative) by `size`; where it is an
    object's that is not a module (a config every layer shares), on this module's own copy."""
    *path, leaf = attribute.split(".")
    owner = block
    for part in path:
        child = getattr(owner, part)
        if not isinstance(child, nn.Module):
            child = copy.copy(child)
            setattr(owner, part, child)
        owner = child
    setattr(owner, leaf, getattr(owner, leaf) // size)


def _split_norm(norm: nn.Module, tp: Axis) -> None:
    """An RMSNorm over the width a column-parallel linear splits: this rank keeps its part of
    the gain, and the mean of the squares is over the whole width, their sum all-reduced over
    tp in forward (each rank normalises its part by it) and its gradient in backward (every
    rank's part depends on it): `weight * (x * rsqrt(mean(x^2) + eps))` in fp32, cast back."""
    width, eps = norm.weight.shape[0], norm.variance_epsilon
    norm.weight = nn.Parameter(norm.weight.detach().chunk(tp.size)[tp.rank].clone())

    def forward(x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.to(torch.float32)
        squares = x.pow(2).sum(-1, keepdim=True)
        variance = reduce_from_tp(copy_to_tp(squares, tp.group), tp.group) / width
        return (norm.weight * (x * torch.rsqrt(variance + eps))).to(dtype)

    norm.forward = forward


def row_parallel_biases(chunk: nn.Module) -> set[str]:
    """The biases of the row-parallel linears `apply_tp` splits in `chunk`: replicated over tp,
    added by one rank, their gradients summed over tp (`_bias_once`)."""
    plan = plan_of(chunk)
    return {f"{plan.blocks}.{i}.{path}.bias" for i, block in _blocks(chunk, plan).items()
            for path, dim in block_splits(plan, block).items()
            if dim == 1 and getattr(block.get_submodule(path), "bias", None) is not None}


def _wrap_half(module: nn.Module, group: ProcessGroup, rank: int,
               sequence_parallel: bool) -> None:
    """One collective into the block half (its first argument) and one out of it (its output,
    or the first element of a tuple it returns); without SP, the half's dropout masks drawn per
    tp rank (`dropout.SplitRegionRng`)."""
    enter = gather_from_sp if sequence_parallel else copy_to_tp
    leave = reduce_scatter_to_sp if sequence_parallel else reduce_from_tp
    rng = None if sequence_parallel else SplitRegionRng(rank)
    # Its name, for callers that pass it by keyword (transformers' layers call their attention so).
    first = next(iter(inspect.signature(module.forward).parameters))

    def pre(mod, args, kwargs):
        x = args[0] if args else kwargs[first]
        if rng is not None:
            rng.enter(x.device)
        whole = enter(x, group)
        if sequence_parallel:  # its column-parallel linears keep x, the shard
            whole = mark(whole, x, group)
        if args:
            return (whole, *args[1:]), kwargs
        return args, {**kwargs, first: whole}

    def post(mod, args, out):
        if rng is not None:
            rng.leave()
        if isinstance(out, tuple):
            return (leave(out[0], group), *out[1:])
        return leave(out, group)

    # Under `train.compile` the hooks run whole and eagerly between the compiled pieces of a
    # block (plait/parallel/compile.py): one graph break each, nothing of theirs traced.
    module.register_forward_pre_hook(torch.compiler.disable(pre), with_kwargs=True)
    module.register_forward_hook(torch.compiler.disable(post))


def apply_tp(chunk: nn.Module, tp: Axis, sequence_parallel: bool = False,
             record: PlacementRecord | None = None) -> set[str]:
    """Split a model or pipeline chunk across the ranks of the `tp` axis in place, as its plan
    says; returns the names of the parameters it split (the others are replicated over tp)."""
    size, rank, group = tp.size, tp.rank, tp.group
    if size == 1 and not has_plan(chunk):  # nothing to split; every parameter replicated
        if record is not None:
            record.replicate_all("tp")
        return set()
    plan = needs_plan(chunk, f"parallel.tp={size}")
    misfit = tp_misfit(plan, chunk.args, size)
    if misfit:
        raise ValueError(misfit)
    splits = split_dims(chunk) if size > 1 else {}
    full = {n: tuple(p.shape) for n, p in chunk.named_parameters()}
    partial = {f"{plan.blocks}.{i}.{path}" for i, block in _blocks(chunk, plan).items()
               for path in matching((n for n, _ in block.named_parameters()),
                                    plan.tp_partial_grads)}
    if size > 1:  # added by one tp rank, their gradient summed over tp
        partial |= row_parallel_biases(chunk)
    if sequence_parallel:  # every replicated parameter sees a shard of the tokens
        partial |= full.keys() - splits.keys()
    if size > 1:
        for block in _blocks(chunk, plan).values():
            _split_block(block, plan, tp, sequence_parallel)
        enter = gather_from_sp if sequence_parallel else copy_to_tp
        tied = _tied(chunk, plan)
        for name in _vocab(chunk, plan):
            if name == plan.vocab_embedding:
                setattr(chunk, name, VocabParallelEmbedding(getattr(chunk, name), tp,
                                                             sequence_parallel))
            else:  # column-parallel head: (b, s, V / T)
                head = getattr(chunk, name)
                _split_linear(head, 0, rank, size)
                head.register_forward_pre_hook(lambda mod, a: (enter(a[0], group),))
                # A model that computes its own loss reads whole logits: set while it does
                # (`Parallelized.step`, for micro-batches without targets).
                head.whole_logits = False
                head.register_forward_hook(
                    lambda mod, a, out: gather_from_tp(out, group) if mod.whole_logits else None)
        if tied:  # both split by vocabulary rows alike: they share this rank's rows again
            getattr(chunk, plan.vocab_head).weight = getattr(chunk, plan.vocab_embedding).weight
        if sequence_parallel:
            chunk.seq_shards = size  # hidden states between chunks: (b, s / T, h)
        params = dict(chunk.named_parameters())
        for name in sorted(partial):
            params[name].register_hook(lambda grad: all_reduced(grad, group))
        _verify(chunk, full, splits, size)
    if record is not None:
        if size > 1:
            record.split_norms += [f"{plan.blocks}.{i}.{path}" for i in _blocks(chunk, plan)
                                   for path in plan.tp_norms]
        for name in full:
            if name in splits:
                record.shard(name, "tp", splits[name])
            else:
                record.replicate(name, "tp", partial_grad=name in partial)
    return set(splits)


def _split_block(block: nn.Module, plan: ModelPlan, tp: Axis, sequence_parallel: bool) -> None:
    """One block to this rank's part: its planned linears split, its head counts divided, a
    collective into and out of each half."""
    for path, dim in block_splits(plan, block).items():
        _split_linear(block.get_submodule(path), dim, tp.rank, tp.size)
        if sequence_parallel and dim == 0:
            keep_shard(block.get_submodule(path))
    for path in plan.tp_norms:
        _split_norm(block.get_submodule(path), tp)
    for attribute in plan.tp_heads:  # this rank's heads
        _divide(block, attribute, tp.size)
    for half in plan.tp_halves:
        _wrap_half(block.get_submodule(half), tp.group, tp.rank, sequence_parallel)


def _verify(chunk: nn.Module, full: dict[str, tuple[int, ...]], splits: dict[str, int],
            size: int) -> None:
    """Check that the transform happened: every split weight has 1/T of its `full` shape along
    its dim, every block half splits some linear and communicates, and the embedding was
    replaced."""
    plan = plan_of(chunk)
    params = dict(chunk.named_parameters())
    if splits.keys() - params.keys():
        raise RuntimeError(f"planned shards missing: {sorted(splits.keys() - params.keys())}")
    for name, dim in splits.items():
        want = list(full[name])
        want[dim] //= size
        got = tuple(params[name].shape)
        if got != tuple(want):
            raise RuntimeError(f"{name.removesuffix('.weight')} was not split: {got}, "
                               f"expected {tuple(want)}")
    for i, block in _blocks(chunk, plan).items():
        split = block_splits(plan, block)
        for path in plan.tp_halves:
            half = block.get_submodule(path)
            if not any(s.startswith(f"{path}.") for s in split):
                raise RuntimeError(f"{plan.blocks}.{i}.{path}: the plan splits none of its "
                                   "linears (it would be computed whole on every rank)")
            if not (half._forward_pre_hooks and half._forward_hooks):
                raise RuntimeError(f"{plan.blocks}.{i}.{path}: a block half has no "
                                   "tensor-parallel collectives")
    embedding = plan.vocab_embedding
    if embedding and hasattr(chunk, embedding) and not isinstance(getattr(chunk, embedding),
                                                                  VocabParallelEmbedding):
        raise RuntimeError(f"{embedding} was not made vocabulary-parallel")
