"""Wrap policies: which modules of a model with no plan are ZeRO-3 units or are checkpointed.

A model family's plan names its blocks, and every parallelism reads them there. Any other
`nn.Module` says it with a policy, as torch FSDP's auto-wrap does:

- `classes`: every module of one of these classes (a residual block, a decoder layer);
- `min_params`: bottom-up, every module whose parameters not already inside a chosen module
  number at least this many (torch's `size_based_auto_wrap_policy`).

Chosen modules never nest: a module inside a chosen one is part of it. The root module itself is
never chosen, nor a container that is never called (one with no `forward` of its own:
`ModuleList`, `ModuleDict`; torch's size policy excludes them too): a unit is gathered when its
module runs, and a container's parameters are used by other modules' forwards. Under ZeRO-3 what
is left over (the stem, the classifier, and parameters that several chosen modules share) forms
one more unit, gathered for the whole forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class WrapPolicy:
    classes: tuple[type[nn.Module], ...] = ()
    min_params: int = 0  # 0: no size rule

    def __bool__(self) -> bool:
        return bool(self.classes) or self.min_params > 0


def policy_of(model: nn.Module, text: str = "") -> WrapPolicy:
    """`parallel.wrap` for `model`: class names (matched against the classes of its modules) or a
    parameter count; "" the model's own `unit_classes` (a transformers family's decoder layer,
    `plait.model.hf.PlainCausalLM`), or none."""
    if not text:
        return WrapPolicy(classes=tuple(getattr(model, "unit_classes", ())))
    if text.isdigit():
        return WrapPolicy(min_params=int(text))
    names = [n.strip() for n in text.split(",")]
    classes = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in classes]
    if missing:
        held = sorted({type(m).__name__ for m in model.modules()
                       if next(m.parameters(recurse=False), None) is not None})
        raise ValueError(f"parallel.wrap: no module of class {', '.join(missing)} in this "
                         f"model; its classes with parameters: {', '.join(held)}")
    return WrapPolicy(classes=tuple(classes[n] for n in names))


def wrapped_modules(root: nn.Module, policy: WrapPolicy) -> list[nn.Module]:
    """The modules `policy` chooses in `root`, in registration order (for the models this is
    meant for, the order they run in), none inside another."""
    chosen: list[nn.Module] = []
    if policy.classes:
        for _, module in root.named_modules():
            if module is not root and isinstance(module, policy.classes) and callable_(module) \
                    and not any(_inside(module, c) for c in chosen):
                chosen.append(module)
    if policy.min_params > 0:
        _by_size(root, policy.min_params, chosen, top=True)
    order = {id(m): i for i, (_, m) in enumerate(root.named_modules())}
    return sorted(chosen, key=lambda m: order[id(m)])


def callable_(module: nn.Module) -> bool:
    """Whether the module has a forward of its own (containers do not: they are never called)."""
    return type(module).forward is not nn.Module.forward


def _inside(module: nn.Module, outer: nn.Module) -> bool:
    return any(m is module for m in outer.modules())


def _by_size(module: nn.Module, threshold: int, chosen: list[nn.Module], top: bool) -> int:
    """Choose, deepest first, the modules holding >= `threshold` parameters not yet chosen; returns
    how many of `module`'s parameters remain unchosen."""
    if any(m is module for m in chosen):
        return 0
    left = sum(p.numel() for p in module.parameters(recurse=False))
    for child in module.children():
        left += _by_size(child, threshold, chosen, top=False)
    if not top and left >= threshold and callable_(module):
        chosen.append(module)
        return 0
    return left
