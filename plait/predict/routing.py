"""transformers' mixtures of experts on fake tensors (a trace), as on real ones.

transformers' experts modules (Mixtral's `MixtralExperts` and the families built like it: weights
stacked by expert, called as experts(x (T, dim), top_k_index (T, k), top_k_weights (T, k))) run
one of two implementations, as the model's config says:

- "grouped_mm" (transformers' default where torch has it): the assignments sorted by expert,
  every expert's rows through its matrices in one `torch._grouped_mm` per projection. Nothing
  reads values, but torch's shape function for that kernel (its "meta" implementation) accepts
  bf16 only: `FakeExperts` gives its output's shape for any dtype. (Its rows are its inputs'
  whatever the routing: a trace keeps what a run keeps.)
- "eager": a loop over the experts the tokens chose,

      expert_hit = (one_hot(top_k_index, E + 1).sum(...) > 0).nonzero()     # which experts
      for expert_idx in expert_hit:
          if expert_idx == E: continue                                      # the "none" class
          top_k_pos, token_idx = torch.where(expert_mask[expert_idx])       # its assignments

  whose three answers read values. Inside such a module's forward `FakeExperts` gives them as
  an even routing would (as `plait.model.moe` routes its own fake tokens, and as a plan prices
  them): every expert hit (E rows), expert e its even share of the T k assignments (the first
  T k mod E experts one more), no hit the "none" class. What the loop keeps for backward is
  linear in each expert's rows: the trace equals a run in which every expert received rows.

Every other operation runs as on real tensors.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from plait.model.moe import even
from plait.model.plan import has_plan, plan_of

_aten = torch.ops.aten


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> tuple[int, ...]:
    if a.dim() == 2 and b.dim() == 2:  # (K, S) x (S, N), S grouped: one (K, N) per group
        return (offs.shape[0], a.shape[0], b.shape[1])
    if a.dim() == 2:  # (S, K) x (E, K, N), S grouped
        return (a.shape[0], b.shape[2])
    if b.dim() == 2:  # (E, M, K) x (K, N), N grouped
        return (a.shape[1], b.shape[1])
    return (a.shape[0], a.shape[1], b.shape[2])  # batched


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of `torch._grouped_mm` (torch 2.13's counter has no formula: it counted nothing):
    two per multiply-add of each group's product."""
    if len(a_shape) == 2 and len(b_shape) == 2:  # the groups split the contraction
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


class FakeExperts(TorchDispatchMode):
    """For a whole traced step: `_grouped_mm` by its output's shape; inside an eager experts
    module's forward (`inside` > 0), the loop's value-reading answers of an even routing."""

    def __init__(self):
        super().__init__()
        self.inside = 0
        self.experts = 0
        self.shares: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._grouped_mm.default:
            a, b, offs = args[0], args[1], kwargs.get("offs", args[2] if len(args) > 2 else None)
            return torch.empty(_grouped_mm_shape(a, b, offs),
                               dtype=kwargs.get("out_dtype") or a.dtype, device=a.device)
        if self.inside and func is _aten.nonzero.default:
            (x,) = args
            if x.dim() == 1:  # the experts hit, of E + 1 classes: all E real ones
                self.experts, self.shares = x.shape[0] - 1, []
                return torch.empty(self.experts, 1, dtype=torch.long, device=x.device)
            k, tokens = x.shape  # one expert's (choice rank, token) mask: its share
            if not self.shares:
                self.shares = even(k * tokens, self.experts)
            return torch.empty(self.shares.pop(0), 2, dtype=torch.long, device=x.device)
        if self.inside and func is _aten._local_scalar_dense.default:
            return 0  # `expert_idx == E`: no hit is the "none" class
        return func(*args, **kwargs)


def _experts_modules(module: nn.Module) -> list[nn.Module]:
    """The transformers experts modules in `module` (its plan's `moe_experts`, in every chunk
    that has one; under ep, the module a `StackedExperts` computes with)."""
    found = []
    for chunk in module.modules():
        if not has_plan(chunk) or plan_of(chunk).moe_experts is None:
            continue
        plan = plan_of(chunk)
        for block in chunk.get_submodule(plan.blocks).values():
            try:
                experts = block.get_submodule(plan.moe_experts)
            except AttributeError:  # a block without a mixture
                continue
            found.append(experts.__dict__.get("local", experts))
    return found


@contextlib.contextmanager
def fake_experts(module: nn.Module) -> Iterator[None]:
    """`FakeExperts` for the duration, knowing when it is inside one of `module`'s transformers
    experts modules (their forwards, recomputations included)."""
    mode = FakeExperts()

    def enter(mod, args):
        mode.inside += 1

    def leave(mod, args, out):
        mode.inside -= 1

    handles = []
    for experts in _experts_modules(module):
        handles.append(experts.register_forward_pre_hook(enter))
        handles.append(experts.register_forward_hook(leave))
    try:
        with mode:
            yield
    finally:
        for h in handles:
            h.remove()
