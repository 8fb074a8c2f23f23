"""The flat parameter: the one storage type of every data-parallel engine (DDP, ZeRO-1/2/3).

Some parameters (all decay, or all no-decay, so that a slice belongs to one optimizer group) are
laid out back to back in one flat buffer, padded to a multiple of the sharding group's size N;
piece r of the buffer is rank r's slice. The parameters become views of the full buffer (`full`),
and the optimizer steps this rank's slice (or its master copy, `Slice`).

- DDP is the case N = 1: each gradient bucket is a flat parameter whose `grad` buffer persists
  (the parameters' `.grad` are views of it) and is all-reduced whole.
- ZeRO-1/2 keep `full` for the whole run; the slice is a view of it, and the updated slices are
  all-gathered back into it after the optimizer step.
- ZeRO-3 keeps only the slice (its own storage); `full` is gathered before use and its storage
  released after (`shard_owns_storage=True`).

Gradients go the same way in both: each parameter's gradient, pre-divided by the data-parallel
degree, is copied into `grad` (the full flat layout, in the reduction dtype) and reduce-scattered
into `grad_shard`, this rank's slice of the average.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from plait.comm.compression import Segment, layout, members_numel
from plait.parallel.engines.state import Piece, Slice


def optimizer_classes(members: list[tuple[str, nn.Parameter]], matrices: frozenset[str],
                      groups: Mapping[str, str] | None = None) -> list[tuple]:
    """(members, decay, matrix, group) for each class of parameters the optimizer steps alike:
    matrices that a matrix optimizer orthogonalizes (`matrices`: Muon's, by name), other decay
    parameters (matrices and embeddings: dim >= 2), no-decay ones (norm gains), in that order;
    within each, by the user's parameter group (`groups`: name -> group, `plait.prepare(groups=
    ...)`; None without), in the members' order. A flat buffer never mixes classes, so that
    every slice belongs to one optimizer group."""
    classes: dict[tuple, list] = {}
    for n, p in members:
        key = (p.dim() >= 2, n in matrices, groups.get(n) if groups else None)
        classes.setdefault(key, []).append((n, p))
    ordered = sorted(classes.items(), key=lambda kv: (not kv[0][1], not kv[0][0]))  # stable
    return [(cls, decay, matrix, group) for (decay, matrix, group), cls in ordered]


def stepped_classes(flats: list) -> tuple[list, list, list]:
    """What the optimizer steps in flat buffers, by class: (decay, no-decay, matrices), each the
    buffers' slices (or their masters)."""
    return ([f.slice.master for f in flats if f.decay and not f.matrix],
            [f.slice.master for f in flats if not f.decay],
            [f.slice.master for f in flats if f.matrix])


def stepped_by_group(flats: list) -> dict:
    """What the optimizer steps elementwise in flat buffers, by the user's parameter group."""
    out: dict = {}
    for f in flats:
        if not f.matrix:
            out.setdefault(f.group_name, []).append(f.slice.master)
    return out


class FlatParam:
    def __init__(
        self,
        members: list[tuple[str, nn.Parameter]],
        decay: bool | None,  # None: decay and no-decay parameters mixed (DDP's buckets)
        size: int,
        rank: int,
        param_dtype: torch.dtype | None = None,
        master_device: torch.device | None = None,
        shard_owns_storage: bool = False,
        shard_device: torch.device | None = None,
        index: int = 0,
        group=None,
        fill=None,
        matrix: bool = False,  # its members are matrices a matrix optimizer (Muon) steps
        group_name: str | None = None,  # the user's parameter group of its members
    ):
        self.index = index  # position among the engine's flat parameters
        self.matrix, self.group_name = matrix, group_name
        self.replaced: dict = {}  # `_materialize`'s new parameters
        self.group, self.size = group, size  # the ranks it is reduced (and sharded) over
        self.names = [n for n, _ in members]
        self.params = [p for _, p in members]
        self.decay, self.rank = decay, rank
        # Where each parameter lies in the flat layout (also what per-tensor compression reads).
        self.segments: list[Segment] = layout(members)
        self.offsets = [s.offset for s in self.segments]
        total = members_numel(self.segments)
        self.shard_numel = -(-total // size)  # ceil: the buffer is padded to N * shard_numel
        first = self.params[0]
        if first.is_meta:  # a model bigger than one device: only this rank's slice is made
            self._materialize(fill, param_dtype, master_device, shard_device)
        else:
            whole = torch.zeros(self.shard_numel * size, dtype=first.dtype, device=first.device)
            for p, view in zip(self.params, self.views(whole), strict=True):
                view.copy_(p.detach())
            mine = whole[self.mine]
            self.full = whole.to(param_dtype or first.dtype)
            if shard_owns_storage:
                shard = mine.to(device=shard_device or mine.device, dtype=self.full.dtype,
                                copy=True)
            else:
                shard = self.full[self.mine]
            self.slice = Slice(shard, first.dtype, master_device)
            if self.slice.master is not self.slice.shard:
                self.slice.master.copy_(mine)  # the master keeps full precision from the start
            for p, view in zip(self.params, self.views(self.full), strict=True):
                p.data = view  # the parameter now lives in the flat buffer
        self.grad: torch.Tensor | None = None  # (N * shard_numel,) staging for the reduce-scatter
        self.grad_shard: torch.Tensor | None = None  # this rank's averaged gradient slice
        self.grad_shard_memory: torch.Tensor | None = None  # what grad_shard is, each step
        self.ready: set[int] = set()  # positions whose gradient has arrived this step

    def _materialize(self, fill, param_dtype, master_device, shard_device) -> None:
        """From `meta` parameters (ZeRO-3 of a model built on `meta`): this rank's slice from
        `fill(name, start, n)` (elements [start, start + n) of the parameter this rank holds,
        flattened; `plait.model.materialize`), a full buffer with no storage (the first gather
        fills it), and parameters that are views of it in place of the `meta` ones
        (`replaced`: id of the old -> the new, for `swap_parameters`)."""
        first = self.params[0]
        device = fill.device
        mine = torch.zeros(self.shard_numel, dtype=first.dtype, device=device)
        for name, lo, start, n in self.overlaps():
            mine[lo : lo + n] = fill(name, start, n)
        # Allocated, never written (the pages are not touched), and let go once viewed.
        self.full = torch.empty(self.shard_numel * self.size, dtype=param_dtype or first.dtype,
                                device=device)
        new = [nn.Parameter(view, requires_grad=p.requires_grad)
               for p, view in zip(self.params, self.views(self.full), strict=True)]
        self.full.untyped_storage().resize_(0)
        shard = mine.to(device=shard_device or device, dtype=self.full.dtype, copy=True)
        self.slice = Slice(shard, first.dtype, master_device)
        if self.slice.master is not self.slice.shard:
            self.slice.master.copy_(mine)
        self.replaced = {id(p): q for p, q in zip(self.params, new, strict=True)}
        self.params = new

    @property
    def mine(self) -> slice:
        return slice(self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel)

    def view(self, flat: torch.Tensor, position: int) -> torch.Tensor:
        """Parameter `position`'s part of a flat tensor laid out like this one."""
        p, start = self.params[position], self.offsets[position]
        return flat[start : start + p.numel()].view_as(p)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [self.view(flat, i) for i in range(len(self.params))]

    @property
    def key(self) -> str:
        """A name for the buffer, unique in its engine: its first parameter's."""
        return self.names[0]

    @property
    def full_bytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    def overlaps(self):
        """(name, first element in this rank's slice, first element in the parameter flattened,
        number of elements) for each parameter that this rank's slice holds a part of."""
        lo, hi = self.mine.start, self.mine.stop
        for seg in self.segments:
            a, b = max(lo, seg.offset), min(hi, seg.offset + seg.numel)
            if a < b:
                yield seg.name, a - lo, a - seg.offset, b - a

    def grad_pieces(self):
        """(name, the part of this rank's gradient slice that belongs to that parameter)."""
        for name, lo, _, n in self.overlaps():
            yield name, self.grad_shard[lo : lo + n]

    def held_pieces(self) -> list[Piece]:
        """The parts of parameters that the optimizer steps in this rank's slice (its master)."""
        return [Piece(name, self.slice.master, lo, start, n)
                for name, lo, start, n in self.overlaps()]
