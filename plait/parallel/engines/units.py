"""ZeRO-3's units: where a model or pipeline chunk is cut into the groups of parameters that are
gathered and freed together (`zero3.py` runs them; `compose.py` and `placement.py` name them for
the placement record and the formulas). With a plan: the modules with parameters before its
blocks, each block, the modules after them; without one, or where a run names a wrap policy
(units below a block: `parallel.wrap = "Attention,FeedForward"`), the policy's choice (`wrap.py`)
and the unit of what it leaves over."""

from __future__ import annotations

from torch import nn

from plait.model.plan import has_plan, plan_of
from plait.parallel.wrap import WrapPolicy, wrapped_modules


def unit_modules(chunk: nn.Module, wrap: WrapPolicy | None = None) -> list[list[nn.Module]]:
    """A model's (or pipeline chunk's) units in execution order. With a plan: the modules with
    parameters before its blocks (the embedding), each block, the modules with parameters after
    them (the final norm and the head), each where the chunk has them. Without one, or with a
    policy (`wrap`, not empty): `[chunk]` first, the unit of whatever `wrap` leaves over
    (gathered for the whole forward), then each module the policy chooses (`wrap.py`)."""
    return _cut(chunk, wrap)[0]


def first_unit_spans(chunk: nn.Module, wrap: WrapPolicy | None = None) -> bool:
    """Whether the chunk's first unit stays gathered while the others run their forward: the
    leftover unit of a wrap policy (`[chunk]`), or tied embeddings' one unit of the embedding and
    the head."""
    return _cut(chunk, wrap)[1]


def _cut(chunk: nn.Module, wrap: WrapPolicy | None) -> tuple[list[list[nn.Module]], bool]:
    if not has_plan(chunk) or wrap:
        chosen = wrapped_modules(chunk, wrap or WrapPolicy())
        owners = _owners(chunk, chosen)
        rest = any(owners[id(p)] is None for p in chunk.parameters())
        return ([[chunk]] if rest else []) + [[m] for m in chosen], rest and bool(chosen)
    blocks = chunk.get_submodule(plan_of(chunk).blocks)
    before, after, seen = [], [], False
    for child in chunk.children():
        if child is blocks:
            seen = True
        elif any(True for _ in child.parameters()):
            (after if seen else before).append(child)
    first = {id(p) for m in before for p in m.parameters()}
    if any(id(p) in first for m in after for p in m.parameters()):
        # Tied embeddings: the embedding and the head are one matrix, so one unit, gathered
        # from the embedding's forward to the head's (as the leftover unit of a wrap policy).
        return [before + after] + [[b] for b in blocks.values()], len(blocks) > 0
    return ([before] if before else []) + [[b] for b in blocks.values()] + \
        ([after] if after else []), False


def _owners(chunk: nn.Module, chosen: list[nn.Module]) -> dict[int, nn.Module | None]:
    """The chosen module each parameter of `chunk` belongs to (by id), or None: left over, or
    shared, reached by its names (`named_parameters(remove_duplicate=False)`) through more than
    one chosen module or through one and the rest of the tree (tied weights, a module used in
    two places)."""
    at = {name: m for name, m in chunk.named_modules(remove_duplicate=False)
          if any(m is c for c in chosen)}
    seen: dict[int, set] = {}
    module_of: dict[int, nn.Module] = {}
    for name, p in chunk.named_parameters(remove_duplicate=False):
        parts = name.split(".")
        owner = next((at[".".join(parts[:k])] for k in range(len(parts) - 1, 0, -1)
                      if ".".join(parts[:k]) in at), None)
        seen.setdefault(id(p), set()).add(id(owner) if owner is not None else None)
        if owner is not None:
            module_of[id(owner)] = owner
    return {k: module_of[next(iter(o))] if len(o) == 1 and None not in o else None
            for k, o in seen.items()}


def unit_params(units: list[list[nn.Module]]) -> list[list[nn.Parameter]]:
    """Each unit's parameters: its modules', less those of a later unit (the leftover unit
    `[chunk]` contains the chosen modules), each parameter once. A parameter shared between a
    chosen module and another part of the tree (`_owners`) belongs to the leftover unit, which
    stays gathered while any of them runs: in a sharer's unit it would be freed while another
    reads it."""
    leftover = len(units) > 1 and len(units[0]) == 1 and \
        all(any(m is n for n in units[0][0].modules()) for u in units[1:] for m in u)
    shared: set[int] = set()
    if leftover:
        owners = _owners(units[0][0], [u[0] for u in units[1:]])
        shared = {k for k, owner in owners.items() if owner is None}
    out, taken = [], set(shared)
    for index in reversed(range(len(units))):
        if index == 0:
            taken -= shared
        mine = []
        for m in units[index]:
            for p in m.parameters():
                if id(p) not in taken:
                    taken.add(id(p))
                    mine.append(p)
        out.append(mine)
    return out[::-1]


def unit_names(chunk: nn.Module, wrap: WrapPolicy | None = None) -> list[tuple[str, ...]]:
    """The names of the parameters each unit of `unit_modules(chunk, wrap)` gathers, in its
    order: the trainable ones (a unit of frozen ones alone is empty: the engine makes none)."""
    names = {id(p): n for n, p in chunk.named_parameters()}
    modules = unit_modules(chunk, wrap)
    return [tuple(names[id(p)] for p in params if p.requires_grad)
            for params in unit_params(modules)]


def block_of(name: str) -> str | None:
    """The block a parameter belongs to, its name up to the first index (`layers.3`), or None
    (a parameter before or after the blocks)."""
    parts = name.split(".")
    index = next((k for k, p in enumerate(parts) if p.isdigit()), None)
    return None if index is None else ".".join(parts[:index + 1])


def unit_prefixes(names) -> list[tuple[str, ...]]:
    """The parameter-name prefixes of each unit, in the order of `unit_modules`, for parameters
    named as in the single-device model (`names` in execution order): a block's parameters are
    those up to the first integer in their name (`layers.3.`), and the parameters before the
    first block and after the last form one unit each."""
    out, seen, loose = [], set(), []
    for name in names:
        block = block_of(name)
        if block is None:  # before or after the blocks: grouped until the next block
            prefix = name.rsplit(".", 1)[0] + "." if "." in name else name
            if prefix not in loose:
                loose.append(prefix)
            continue
        if loose:
            out.append(tuple(loose))
            loose = []
        key = (block + ".",)
        if key not in seen:
            seen.add(key)
            out.append(key)
    if loose:
        out.append(tuple(loose))
    return out
