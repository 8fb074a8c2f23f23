"""The placement record: for every parameter this rank holds, how the mesh axes place it.

Each transform of `parallelize` writes its axis into the record as it applies itself:

- `pp` shards every parameter *by stage*: the whole tensor lives on one pipeline coordinate
  (recorded with dim None);
- `tp` shards a split weight along a tensor dim (this rank holds slice `index` of `size`) and
  replicates the rest (norm gains);
- `dp`, `cp`, `ep` replicate (ZeRO partitions the *storage* of the dp replicas into flat slices;
  that layout belongs to the data-parallel engine, see `flat.py`).

The record is then complete: every parameter has every axis exactly once, as a shard or as a
replica (`check`). It answers what the rest of plait needs to know without asking which
transforms ran: the full and local shapes (model-state accounting, checkpoints), the axes a
gradient must be summed over (`grad_sync_axes`), and which rank counts a replicated tensor in the
one global gradient norm (`counts_once`).

Beside the placements the record carries two things the formulas read as the engine builds them:
ZeRO-3's units (`ZeroUnit`), and what the optimizer needs of the engine's flat buffers
(`OptimizerClasses`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from plait.mesh import AXES


@dataclass(frozen=True)
class AxisShard:
    dim: int | None  # tensor dim split along the axis; None: the whole tensor on one coordinate
    index: int  # this rank's piece
    count: int  # pieces in all


@dataclass
class ParamPlacement:
    shape: tuple[int, ...]  # the full, unsharded tensor's shape
    shards: dict[str, AxisShard] = field(default_factory=dict)
    replicated: set[str] = field(default_factory=set)
    # Replicated axes over which the ranks compute partial gradients that must be summed: dp (other
    # rows of the batch), tp for the norm gains under sequence parallelism (other tokens).
    partial_grad: set[str] = field(default_factory=set)

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        for s in self.shards.values():
            if s.dim is not None:
                shape[s.dim] //= s.count
        return tuple(shape)

    @property
    def origin(self) -> tuple[int, ...]:
        """Where this rank's piece starts in the full tensor."""
        origin = [0] * len(self.shape)
        for s in self.shards.values():
            if s.dim is not None:
                origin[s.dim] += s.index * (self.shape[s.dim] // s.count)
        return tuple(origin)

    @property
    def piece(self) -> tuple[int, int]:
        """(which, of how many): this rank's piece among all those the sharded axes cut the
        tensor into, numbered over the axes in name order."""
        which, count = 0, 1
        for axis in sorted(self.shards):
            s = self.shards[axis]
            which, count = which * s.count + s.index, count * s.count
        return which, count

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)


@dataclass(frozen=True)
class ZeroUnit:
    """One of ZeRO-3's units as the engine cuts it (`units.unit_names`: a plan's block, or a wrap
    policy's module): its parameters by name, its pipeline chunk (counted from 0 on this stage),
    and whether it spans the chunk (`units.first_unit_spans`: gathered while the chunk's other
    units run)."""

    names: tuple[str, ...]
    chunk: int
    spans: bool


@dataclass(frozen=True)
class OptimizerClasses:
    """What an optimizer needs of the engine: the parameters it steps as whole matrices (Muon's,
    or what `plait.prepare(whole=...)` names) and each parameter's group (`plait.prepare`'s
    `groups`), each kept in flat buffers of its own; the formulas lay buffers out the same."""

    matrices: frozenset[str] = frozenset()
    groups: dict[str, str] = field(default_factory=dict)  # name -> the user's parameter group


class PlacementRecord:
    """Placements by parameter name (the single-device model's names), for one rank."""

    def __init__(self, coords: dict[str, int], sizes: dict[str, int]):
        self.coords, self.sizes = coords, sizes
        self.params: dict[str, ParamPlacement] = {}
        self.chunk_of: dict[str, int] = {}  # parameter name -> its pipeline chunk (global index)
        self.units: list[ZeroUnit] = []  # `place` sets them, the formulas read them
        # Parameters no optimizer steps (`requires_grad=False`): name -> bytes per element.
        # Every engine keeps them whole, in no flat buffer (`SyncedReplicas.frozen_pieces`).
        self.frozen: dict[str, int] = {}
        # Norms over a tp-split width (`ModelPlan.tp_norms`), each summing its squares over tp
        # in forward and its gradient's in backward: `apply_tp` notes them, the formulas count.
        self.split_norms: list[str] = []
        self.optimizer = OptimizerClasses()  # `place` sets it once

    def add(self, name: str, shape: tuple[int, ...]) -> None:
        self.params[name] = ParamPlacement(tuple(shape))

    def drop(self, name: str) -> None:
        """Not held on this rank (another pipeline stage holds it)."""
        del self.params[name]

    def shard(self, name: str, axis: str, dim: int | None) -> None:
        self.params[name].shards[axis] = AxisShard(dim, self.coords[axis], self.sizes[axis])

    def replicate(self, name: str, axis: str, partial_grad: bool = False) -> None:
        self.params[name].replicated.add(axis)
        if partial_grad and self.sizes[axis] > 1:
            self.params[name].partial_grad.add(axis)

    def replicate_all(self, axis: str, partial_grad: bool = False) -> None:
        for name in self.params:
            self.replicate(name, axis, partial_grad)

    def check(self, local_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        """Every parameter has every axis exactly once (shard xor replica); with `local_shapes`,
        the tensors held have the shapes the record says. Raises naming the first fault."""
        for name, p in self.params.items():
            for axis in AXES:
                n = (axis in p.shards) + (axis in p.replicated)
                if n != 1:
                    raise RuntimeError(f"placement of {name}: axis {axis} recorded {n} times")
        if local_shapes is not None:
            if local_shapes.keys() != self.params.keys():
                diff = sorted(local_shapes.keys() ^ self.params.keys())
                raise RuntimeError(f"held parameters and placement record differ: {diff}")
            for name, shape in local_shapes.items():
                if tuple(shape) != self.params[name].local_shape:
                    raise RuntimeError(f"{name} is {tuple(shape)} here; its placement says "
                                       f"{self.params[name].local_shape}")

    def grad_sync_axes(self) -> set[str]:
        """Axes over which some parameter's gradient is a partial sum."""
        return {a for p in self.params.values() for a in p.partial_grad}

    def counts_once(self, name: str, over: set[str]) -> bool:
        """Whether this rank counts `name` in a sum over the ranks of the axes `over` (the global
        gradient norm): shards always, replicas only on the first coordinate of each of those
        axes that replicates them."""
        return all(self.coords[a] == 0 for a in self.params[name].replicated if a in over)

    def held_numel(self) -> int:
        return sum(p.local_numel for p in self.params.values())
