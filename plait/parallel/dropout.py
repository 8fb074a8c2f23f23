"""Where dropout's masks come from under a layout (the semantics of Megatron-LM's RNG tracker), and
dropout switched off for a comparison with one process (`--verify`).

A single device draws one mask over a whole activation. A layout splits that activation, or
copies it, over ranks; each rank's mask must then be what its part of one device's mask would
be: independent where the ranks hold different elements, equal where they hold the same ones.

- Ranks holding different rows or tokens (dp, cp, ep) or different layers (pp) draw independent
  masks: `seed_ranks` reseeds every rank's default generator from one number drawn from it
  (the same on every rank of a job seeded alike) and the rank's coordinates on those axes.
- The tp ranks of a group hold the same activations in the replicated region (the residual
  stream between the block halves, after a row-parallel all-reduce): `seed_ranks` leaves their
  generators equal, so their masks, and their copies of the stream, stay equal.
- Inside a block half (after its column-parallel linears, before its row-parallel ones) each tp
  rank holds other heads or hidden units: its masks must differ. Entering a half
  (`SplitRegionRng`), the default generator draws one number, alike on the tp ranks (so the
  replicated stream stays in step), and the half runs on a generator seeded from that number
  and the tp rank; leaving it, the replicated stream continues. That seed is a function of the
  generator's state on entry, which activation checkpointing restores before it recomputes: a
  recomputed half draws its first masks again.
- Under sequence parallelism no region is replicated (outside the halves each tp rank holds a
  shard of the tokens): the tp rank is one more coordinate of `seed_ranks`, and the halves need
  no fork.

A layout's dropout masks cannot be one process's (they are drawn in other places, from other
streams), so a step with dropout differs from one process's by design: `dropout_off` switches it
off for `--verify` and `Prepared.verify`, which say so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

_MIX = 1_000_003  # folds a coordinate into a seed
_SEEDS = 2**62


def _drawn() -> int:
    """One number from the default generator, which it advances (a real draw, also during a
    trace on fake tensors)."""
    with unset_fake_temporarily():
        return int(torch.randint(_SEEDS, (1,)).item())


def _mixed(seed: int, *coordinates: int) -> int:
    for c in coordinates:
        seed = (seed * _MIX + c + 1) % _SEEDS
    return seed


def seed_ranks(axes: dict, sequence_parallel: bool) -> None:
    """Reseed this rank's default generator (CPU and accelerators) for its dropout masks: from
    one number drawn from it and the rank's coordinates on every axis but tp (unless sequence
    parallelism makes tp ranks hold different tokens)."""
    names = [a for a in ("dp", "pp", "cp", "ep", "tp") if a != "tp" or sequence_parallel]
    base = _drawn()
    torch.manual_seed(_mixed(base, *(axes[a].rank for a in names)))


def _seed_forked(seed: int, device: torch.device) -> None:
    """Seed the generators `fork_rng` saved: the CPU's and, on a GPU, that device's. (Not
    torch.manual_seed: it seeds every accelerator too, and for each kind not yet started queues
    a lazy call holding its formatted stack, 20 ms a call on a CPU; it ran per block half per
    micro-batch.)"""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)


class SplitRegionRng:
    """Enter and leave a block half's region, whose masks differ per tp rank (see the module's
    docstring); `enter` and `leave` pair around the half's forward (its hooks)."""

    def __init__(self, tp_rank: int):
        self.tp_rank = tp_rank
        self._forks: list[contextlib.ExitStack] = []

    def enter(self, device: torch.device) -> None:
        """Before the half's forward, on the device of its input."""
        seed = _drawn()  # the replicated stream moves on alike on the tp ranks
        stack = contextlib.ExitStack()
        stack.enter_context(torch.random.fork_rng([device] if device.type == "cuda" else [],
                                                  device_type=device.type))
        _seed_forked(_mixed(seed, self.tp_rank), device)
        self._forks.append(stack)

    def leave(self) -> None:
        self._forks.pop().close()


def _rates(module: nn.Module) -> Iterator[tuple[object, str]]:
    """(owner, attribute) of every dropout probability in `module`: torch's dropout modules'
    `p`, and float attributes named like one (transformers' `attention_dropout`, passed to
    the attention kernel as `dropout_p`)."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            yield m, "p"
        for name, value in vars(m).items():
            if "dropout" in name and isinstance(value, float):
                yield m, name


@contextlib.contextmanager
def dropout_off(*modules: nn.Module) -> Iterator[int]:
    """Every dropout of `modules` at probability 0 for the duration; yields how many were on."""
    saved = [(owner, name, getattr(owner, name)) for m in modules for owner, name in _rates(m)]
    try:
        for owner, name, _ in saved:
            setattr(owner, name, 0.0)
        yield sum(1 for *_, value in saved if value > 0)
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
