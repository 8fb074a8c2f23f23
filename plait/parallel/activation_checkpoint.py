"""Activation checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost";
selective recomputation after Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 5): drop tensors saved for backward and recompute them.

`train.activation_checkpointing`:

- "none": everything the backward needs is kept.
- "full": each transformer block keeps only its input; its forward runs again in its backward
  (one extra forward per block, including its tensor-parallel collectives).
- "selective": the matmul inputs and outputs are kept; the cheap, memory-hungry operations between
  them (the model plan's `recompute`; for plait's Llama the two RMSNorms, rotary embedding +
  attention core) keep only their inputs and are recomputed. (Its SwiGLU gate is made again in
  backward in every mode: `model/feed_forward.py`.) No collective runs
  again.

Applied with torch's composable `checkpoint` (hooks on the module; names unchanged). Its
recomputation runs under `recomputing()`, so that hooks of other transforms that must not act
twice in a step (ZeRO-3's prefetch and free) can tell.
"""

from __future__ import annotations

import contextlib
import weakref

from torch import nn
from torch.distributed._composable import checkpoint

from plait.model.plan import has_plan, matching, needs_plan
from plait.parallel.wrap import WrapPolicy, wrapped_modules

MODES = ("none", "full", "selective")

_recomputing = 0  # depth of recomputations under way (backward may run on another thread)
_checkpointed: weakref.WeakSet = weakref.WeakSet()  # the modules checkpointed here


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `module`'s forward is recomputed in the backward (`apply_activation_checkpointing`
    checkpointed it)."""
    return module in _checkpointed


def _checkpoint(module: nn.Module) -> None:
    checkpoint(module, context_fn=_contexts)
    _checkpointed.add(module)


def recomputing() -> bool:
    """True while a checkpointed module's forward is being recomputed in the backward."""
    return _recomputing > 0


class _Recomputing:
    """Entered around each recomputation; reusable (a graph kept for a second backward, as the
    zero-bubble schedules keep it, recomputes twice)."""

    def __enter__(self):
        global _recomputing
        _recomputing += 1

    def __exit__(self, *exc):
        global _recomputing
        _recomputing -= 1


def _contexts():
    return contextlib.nullcontext(), _Recomputing()


def checkpointed_modules(block: nn.Module, mode: str, recompute=()) -> list[nn.Module]:
    """The modules of one block whose forward is recomputed under `mode`; "selective": those
    matching the model plan's `recompute` patterns."""
    if mode == "full":
        return [block]
    if mode == "selective":
        paths = matching((path for path, _ in block.named_modules()), recompute)
        return [block.get_submodule(path) for path in paths]
    return []


def apply_activation_checkpointing(chunk: nn.Module, mode: str,
                                   modules: WrapPolicy | None = None) -> int:
    """Checkpoint every block of a model or pipeline chunk in place; returns how many modules. A
    model with no plan names what "full" checkpoints with a policy (`modules`: classes, or a
    size); "selective" needs a plan."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing is one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        return 0
    if not has_plan(chunk) and mode == "full":
        chosen = wrapped_modules(chunk, modules or WrapPolicy())
        if not chosen:
            raise ValueError(f"activation checkpointing = 'full' on {type(chunk).__name__}, "
                             "which has no plan: name the modules to recompute (checkpoint="
                             "plait.WrapPolicy(classes=(Block,)))")
        for module in chosen:
            _checkpoint(module)
        return len(chosen)
    plan, count = needs_plan(chunk, f"activation checkpointing = {mode!r}"), 0
    for block in chunk.get_submodule(plan.blocks).values():
        for module in checkpointed_modules(block, mode, plan.recompute):
            _checkpoint(module)
            count += 1
    return count
