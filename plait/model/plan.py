"""A model plan: what the parallelisms need to know about a model family, as data.

`plait/parallel/` reads plans and never names a model's modules; adding a family is one plan file
beside its model (torchtitan's per-model `parallelize` + `sharding.py`, Hugging Face's
`base_model_tp_plan`). Module paths inside a block are patterns matched with `fnmatch` against
`named_modules()` paths, where `*` also spans dots (`feed_forward.experts.*.w1` matches every
expert's w1).

A model (or a pipeline chunk of one) carries its plan as the attribute `plan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the plans are data: the checks read them without importing torch
    from torch import nn


@dataclass(frozen=True)
class ModelPlan:
    """A model family's plan. The model class also provides its forward in three pieces, which a
    pipeline chunk runs on the modules it holds: `embed(inputs) -> h`, `block_args(h, seq_len)
    -> the blocks' other arguments`, `head(h) -> outputs`; each block is called as
    `block(h, *block_args)`, or `block(h, **block_args)` when they are a dict."""

    family: str
    # The container of the repeated blocks (an nn.ModuleDict keyed by the global block index).
    blocks: str
    # Fields of `model.args` (the family's config): the width of the residual stream, what passes
    # between pipeline stages as (rows, seq, width); the vocabulary size, which a
    # vocabulary-parallel loss needs.
    hidden_size: str = "hidden_size"
    vocab_size: str = "vocab_size"
    # Pipeline parallelism: the top-level modules the first chunk holds (before the blocks), the
    # last (after them), and the attributes every chunk shares (no parameters).
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()
    # Tensor parallelism (Megatron): block-relative linear pattern -> the dim of its weight that
    # is split, 0 = output rows (column-parallel), 1 = input columns (row-parallel).
    tp_splits: Mapping[str, int] = field(default_factory=dict)
    # The block halves: each starts with column-parallel and ends with row-parallel linears, so
    # one collective goes in (on its first argument) and one comes out.
    tp_halves: tuple[str, ...] = ()
    # Fields of `model.args` that the tp degree must divide (heads, hidden units, vocabulary).
    tp_divides: tuple[str, ...] = ()
    # Block-relative parameters replicated over tp whose gradient is a partial sum over tp
    # anyway (a router whose gates meet only this rank's shard of the expert outputs).
    tp_partial_grads: tuple[str, ...] = ()
    # Top-level modules split by vocabulary: the input embedding, the output head.
    vocab_embedding: str | None = None
    vocab_head: str | None = None
    # Context parallelism: the block-relative attention kernel, the one module that mixes
    # tokens: (q, k, v) after the rotary embedding, (b, s, heads or kv_heads, head_dim) -> causal
    # attention (b, s, heads, head_dim); cp replaces it by one attending across the sequence
    # shards. And the model's attribute holding (seq_len, device) -> the positions of the tokens
    # it sees.
    attention_core: str | None = None
    positions: str | None = None
    # Selective activation checkpointing: the block-relative modules whose forward is cheap and
    # whose saved tensors are large (norms, the attention core, activation functions).
    recompute: tuple[str, ...] = ()
    # The block-relative module that is a mixture of experts in the blocks that have one
    # (plait's `MoEFeedForward`).
    moe: str | None = None
    # Or (transformers' mixtures of experts): the block-relative module holding every expert's
    # weights stacked along dim 0, with attribute `num_experts`, called as experts(x (T, dim),
    # top_k_index (T, k), top_k_weights (T, k)) -> (T, dim).
    moe_experts: str | None = None


def has_plan(module: nn.Module) -> bool:
    return isinstance(getattr(module, "plan", None), ModelPlan)


def needs_plan(module: nn.Module, what: str) -> ModelPlan:
    """The plan of `module`, which `what` (a degree, a mode) needs; else one line naming both."""
    if not has_plan(module):
        raise ValueError(f"{what} needs a model plan, and {type(module).__name__} has none "
                         "(attribute `plan`, a plait.ModelPlan; docs/python.md)")
    return plan_of(module)


def plan_of(module: nn.Module) -> ModelPlan:
    """The plan `module` carries (a model, or a pipeline chunk of one)."""
    plan = getattr(module, "plan", None)
    if not isinstance(plan, ModelPlan):
        raise TypeError(f"{type(module).__name__} has no model plan (attribute `plan`)")
    return plan


def matching(paths, patterns) -> dict[str, str]:
    """Each path that matches one of `patterns` -> the first pattern it matches."""
    out = {}
    for path in paths:
        hit = next((p for p in patterns if fnmatchcase(path, p)), None)
        if path and hit is not None:
            out[path] = hit
    return out


def tp_misfit(plan: ModelPlan, args: object, tp: int) -> str | None:
    """The plan's `tp_divides` fields of `args` that `tp` does not divide, as the one line that
    says so (None when it divides them all): the rule, once, for the checks before launch and
    for `apply_tp`."""
    misfits = [f"{what}={getattr(args, what)}" for what in plan.tp_divides
               if getattr(args, what) % tp]
    return f"tp={tp} must divide {', '.join(misfits)}" if misfits else None
