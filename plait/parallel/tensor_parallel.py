"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
al. 2022) over the `tp` axis, applied in place to a plain `plait.model.Transformer`.

Each block half is a column-parallel layer followed by a row-parallel one:

    attention:    wq, wk, wv split by heads (output rows)  ->  wo split by heads (input columns)
    feed-forward: w1, w3 split by hidden units (rows)      ->  w2 split by hidden units (columns)
    (mixture of experts: each expert's w1, w3, w2 so; the router replicated, its gradient a
    partial sum over tp: each rank's gates meet only its shard of the expert outputs)

so the half needs exactly one collective on the way in and one on the way out, placed by module
hooks around `attention` and `feed_forward` (names and call signatures stay the model's own):

    without SP: in f = copy (all-reduce in backward), out g = all-reduce
    with SP:    in  = all-gather along the sequence, out = reduce-scatter along the sequence

Under sequence parallelism the residual stream, the norms and the dropout-free elementwise work
hold (batch, seq / T, dim): activation memory of those regions divided by T for the same bytes
communicated. The norms then see a shard of the tokens, so their weight gradients are partial sums
and are all-reduced over `tp` as they arrive.

The embedding and the output head are split by vocabulary (`vocab_parallel`).

`apply_tp` works on the whole model or on one pipeline chunk (whatever of the embedding, blocks
and head it holds), and writes the `tp` axis of each parameter into the placement record.
"""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from plait.comm import all_reduced
from plait.comm.autograd import (
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from plait.mesh import Axis
from plait.model.llama import RMSNorm
from plait.model.moe import MoEFeedForward
from plait.parallel.placement import PlacementRecord
from plait.parallel.vocab_parallel import VocabParallelEmbedding

# (module path inside a block, dim of nn.Linear.weight that is split): 0 = output rows
# (column-parallel), 1 = input columns (row-parallel).
BLOCK_SPLITS = {
    "attention.wq": 0, "attention.wk": 0, "attention.wv": 0, "attention.wo": 1,
    "feed_forward.w1": 0, "feed_forward.w3": 0, "feed_forward.w2": 1,
}
# The embedding and the head are split by vocabulary rows.
VOCAB_SPLITS = {"tok_embeddings": 0, "output": 0}


def block_splits(block: nn.Module) -> dict[str, int]:
    """Module path inside `block` -> the dim of its weight that is split. A mixture-of-experts
    feed-forward's experts are split like the dense one; its router is replicated."""
    if not isinstance(block.feed_forward, MoEFeedForward):
        return BLOCK_SPLITS
    out = {p: d for p, d in BLOCK_SPLITS.items() if p.startswith("attention.")}
    for e in block.feed_forward.experts:
        out |= {f"feed_forward.experts.{e}.{w}": d for w, d in (("w1", 0), ("w3", 0), ("w2", 1))}
    return out


def split_dims(chunk: nn.Module) -> dict[str, int]:
    """Parameter name -> the dim `apply_tp` splits, for the parameters of `chunk` it splits."""
    out = {f"layers.{i}.{path}.weight": dim for i, block in chunk.layers.items()
           for path, dim in block_splits(block).items()}
    out |= {f"{m}.weight": dim for m, dim in VOCAB_SPLITS.items() if hasattr(chunk, m)}
    return out


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


def apply_tp(chunk: nn.Module, tp: Axis, sequence_parallel: bool = False,
             record: PlacementRecord | None = None) -> set[str]:
    """Split a model or pipeline chunk across the ranks of the `tp` axis in place; returns the
    names of the parameters it split (the others are replicated over tp)."""
    size, rank, group = tp.size, tp.rank, tp.group
    args = chunk.args
    for what, count in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads),
                        ("ffn_dim", args.ffn_dim), ("vocab_size", args.vocab_size)):
        if count % size:
            raise ValueError(f"tp={size} must divide {what}={count}")
    splits = split_dims(chunk) if size > 1 else {}
    names = [n for n, _ in chunk.named_parameters()]
    if size > 1:
        for block in chunk.layers.values():
            for path, dim in block_splits(block).items():
                _split_linear(block.get_submodule(path), dim, rank, size)
            _wrap_half(block.attention, group, sequence_parallel)
            _wrap_half(block.feed_forward, group, sequence_parallel)
            if isinstance(block.feed_forward, MoEFeedForward):
                block.feed_forward.router.weight.register_hook(
                    lambda grad: all_reduced(grad, group))
        if hasattr(chunk, "tok_embeddings"):
            chunk.tok_embeddings = VocabParallelEmbedding(chunk.tok_embeddings, tp,
                                                          sequence_parallel)
        if hasattr(chunk, "output"):
            _split_linear(chunk.output, 0, rank, size)  # column-parallel head: (b, s, V / T)
            enter = gather_from_sp if sequence_parallel else copy_to_tp
            chunk.output.register_forward_pre_hook(lambda mod, a: (enter(a[0], group),))
        if sequence_parallel:
            chunk.seq_shards = size  # hidden states between chunks: (b, s / T, h)
            # The norms see a shard of the tokens: their weight gradients are partial sums.
            for norm in (m for m in chunk.modules() if isinstance(m, RMSNorm)):
                norm.weight.register_hook(lambda grad: all_reduced(grad, group))
        _verify(chunk, splits, size)
    if record is not None:
        for name in names:
            if name in splits:
                record.shard(name, "tp", splits[name])
            else:
                record.replicate(name, "tp", partial_grad=sequence_parallel
                                 or name.endswith("feed_forward.router.weight"))
    return set(splits)


def _verify(chunk: nn.Module, splits: dict[str, int], size: int) -> None:
    """Check that the transform happened: every split weight has 1/T of its full shape, the
    embedding was replaced, and every block half communicates."""
    args = chunk.args
    full = {
        "attention.wq": (args.n_heads * args.head_dim, args.dim),
        "attention.wk": (args.n_kv_heads * args.head_dim, args.dim),
        "attention.wv": (args.n_kv_heads * args.head_dim, args.dim),
        "attention.wo": (args.dim, args.n_heads * args.head_dim),
        "feed_forward.w1": (args.ffn_dim, args.dim),
        "feed_forward.w3": (args.ffn_dim, args.dim),
        "feed_forward.w2": (args.dim, args.ffn_dim),
        "w1": (args.ffn_dim, args.dim), "w3": (args.ffn_dim, args.dim),
        "w2": (args.dim, args.ffn_dim),  # an expert's
        "tok_embeddings": (args.vocab_size, args.dim),
        "output": (args.vocab_size, args.dim),
    }
    params = dict(chunk.named_parameters())
    if splits.keys() - params.keys():
        raise RuntimeError(f"planned shards missing: {sorted(splits.keys() - params.keys())}")
    for name, dim in splits.items():
        key = name.removesuffix(".weight").split(".", 2)[-1] if name.startswith("layers.") \
            else name.removesuffix(".weight")
        if ".experts." in key:
            key = key.rsplit(".", 1)[-1]
        want = list(full[key])
        want[dim] //= size
        got = tuple(params[name].shape)
        if got != tuple(want):
            raise RuntimeError(f"{name.removesuffix('.weight')} was not split: {got}, "
                               f"expected {tuple(want)}")
    for i, block in chunk.layers.items():
        for half in (block.attention, block.feed_forward):
            if not (half._forward_pre_hooks and half._forward_hooks):
                raise RuntimeError(f"layers.{i}: a block half has no tensor-parallel collectives")
    if hasattr(chunk, "tok_embeddings") and not isinstance(chunk.tok_embeddings,
                                                           VocabParallelEmbedding):
        raise RuntimeError("tok_embeddings was not made vocabulary-parallel")
