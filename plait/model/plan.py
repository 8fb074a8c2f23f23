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
    # Block-relative attributes that count heads, which a module's forward reads to reshape
    # (`self_attn.num_heads`; or a config's the module reads, `self_attn.config.
    # num_attention_heads`, changed on the module's own copy of it): each tp rank holds 1/T of
    # them, so each is divided by T.
    tp_heads: tuple[str, ...] = ()
    # Block-relative RMSNorms over the width a column-parallel linear splits (OLMo2's q_norm and
    # k_norm, over all heads): each rank keeps its part of the gain, and the sum of squares is
    # summed over tp (`weight * (x * rsqrt(mean(x^2) + eps))` in fp32, as OLMo2's norm computes).
    tp_norms: tuple[str, ...] = ()
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


def plan_problem(model: nn.Module, tp: int = 1) -> str | None:
    """What is wrong with the plan `model` carries, as one line naming the plan's field, the
    module and the fix (None when nothing is): checked on the model's modules and weight shapes
    before anything is split or communicated (`plait.prepare`, `plait.estimate`). Each module the
    plan names exists; each `tp_splits` pattern matches linears of the blocks, split along dim 0
    or 1 of a 2-D weight that `tp` divides there; where `model.args` gives the width of the
    residual stream (`hidden_size`), a column-parallel linear (dim 0) reads it whole and a
    row-parallel one (dim 1) writes it, so a swapped dim is named before it fails inside a
    matmul."""
    plan = plan_of(model)
    problem = _top_level_problem(model, plan)
    if problem:
        return problem
    blocks = model.get_submodule(plan.blocks)
    args = getattr(model, "args", None)
    width = getattr(args, plan.hidden_size, None)
    width = width if isinstance(width, int) else None
    for i, block in blocks.items():
        paths = dict(block.named_modules())
        for path in (*plan.tp_halves, *_parents(plan.attention_core), plan.moe,
                     *_parents(plan.moe_experts)):
            if path and path not in paths:
                return (f"plan: {plan.blocks}.{i} has no module {path!r} (its modules: "
                        f"{', '.join(sorted(p for p in paths if p and '.' not in p))})")
        for attribute in plan.tp_heads:
            count = _attribute(block, attribute)
            if not isinstance(count, int):
                return (f"plan.tp_heads: {plan.blocks}.{i}.{attribute} is not a head count of "
                        "the block (a whole number its forward reads)")
            if count % tp:
                return (f"plan.tp_heads: tp={tp} must divide {plan.blocks}.{i}.{attribute} = "
                        f"{count}; choose a tp that does")
        for path in plan.tp_norms:
            norm = paths.get(path)
            if norm is None or getattr(norm, "weight", None) is None or \
                    not hasattr(norm, "variance_epsilon"):
                return (f"plan.tp_norms: {plan.blocks}.{i}.{path} is not an RMSNorm of the "
                        "block (a `weight` and a `variance_epsilon`)")
            if norm.weight.shape[0] % tp:
                return (f"plan.tp_norms: tp={tp} must divide the width of {plan.blocks}.{i}."
                        f"{path}, {norm.weight.shape[0]}")
        splits = matching(paths, plan.tp_splits)
        for path, pattern in splits.items():
            problem = _split_problem(f"{plan.blocks}.{i}.{path}", paths[path],
                                     plan.tp_splits[pattern], pattern, tp, width)
            if problem:
                return problem
        for half in plan.tp_halves:
            if not any(path.startswith(f"{half}.") for path in splits):
                return (f"plan.tp_splits: no pattern matches a linear of {plan.blocks}.{i}."
                        f"{half}, a block half (plan.tp_halves), which tp would compute whole "
                        "on every rank; name its linears (block-relative paths, `*` for any "
                        "part)")
    return None


def _top_level_problem(model: nn.Module, plan: ModelPlan) -> str | None:
    """What the plan names outside the blocks that `model` lacks: the blocks' container, the
    modules the pipeline's chunks keep, the vocabulary's, the fields tp divides."""
    blocks = _submodule(model, plan.blocks)
    if blocks is None or not hasattr(blocks, "items"):
        return (f"plan.blocks: {type(model).__name__} has no module container {plan.blocks!r} "
                "(an nn.ModuleDict of the repeated blocks)")
    for field_name in ("first", "last", "shared"):
        for name in getattr(plan, field_name):
            if not hasattr(model, name):
                return (f"plan.{field_name}: {type(model).__name__} has no attribute {name!r}; "
                        "name the top-level modules the pipeline's chunks keep")
    for field_name in ("vocab_embedding", "vocab_head", "positions"):
        name = getattr(plan, field_name)
        if name is not None and _submodule(model, name) is None and not hasattr(model, name):
            return f"plan.{field_name}: {type(model).__name__} has no module {name!r}"
    missing = [f for f in plan.tp_divides if not hasattr(getattr(model, "args", None), f)]
    if missing:
        return (f"plan.tp_divides: {type(model).__name__}.args has no field "
                f"{', '.join(missing)}; name fields of model.args (heads, hidden units)")
    return None


def _attribute(block: object, dotted: str) -> object:
    """`block.a.b.c` for "a.b.c", None where any part is missing."""
    for part in dotted.split("."):
        block = getattr(block, part, None)
    return block


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _parents(path: str | None) -> tuple[str, ...]:
    """The module that must exist for `path`, put in later (an attention kernel): its parent."""
    parent = (path or "").rpartition(".")[0]
    return (parent,) if parent else ()


def _split_problem(name: str, module: nn.Module, dim: int, pattern: str, tp: int,
                   width: int | None) -> str | None:
    field_name = f"plan.tp_splits[{pattern!r}]"
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 2:
        return (f"{field_name}: {name} is a {type(module).__name__}, not a linear with a 2-D "
                "weight; split the linears of a block half")
    if dim not in (0, 1):
        return (f"{field_name} = {dim!r}: 0 (output rows, column-parallel) or 1 (input "
                "columns, row-parallel)")
    out_features, in_features = weight.shape
    if width is not None:
        if dim == 1 and in_features == width and out_features != width:
            return (f"{field_name} = 1: {name} reads the residual stream ({width} wide), which "
                    "every tp rank holds whole, so it cannot split its input columns; use 0 "
                    "(output rows) for the linears a block half starts with")
        if dim == 0 and out_features == width and in_features != width:
            return (f"{field_name} = 0: {name} writes the residual stream ({width} wide), which "
                    "the half's exit sums over tp; use 1 (input columns) for the linears a block "
                    "half ends with")
    if tp > 1 and weight.shape[dim] % tp:
        return (f"{field_name}: {name}'s weight {tuple(weight.shape)} has {weight.shape[dim]} "
                f"along dim {dim}, which tp={tp} does not divide; choose a tp that does")
    return None


def check_plan(model: nn.Module, tp: int = 1) -> None:
    """Raise `plan_problem`'s line as a ValueError, for a model that carries a plan."""
    problem = plan_problem(model, tp) if has_plan(model) else None
    if problem:
        raise ValueError(problem)
