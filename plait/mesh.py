"""The named device mesh: degrees of (pp, dp, cp, ep, tp) -> a torch `DeviceMesh` over the world.

Axes are laid out row-major in the order of `AXES`, so `tp` is innermost: a tensor-parallel group
is a run of consecutive ranks (one node, on the fastest links), and `pp` is outermost (stages talk
least, point to point, and can cross nodes). Every axis exists in the mesh, with size 1 where the
strategy is off, so a consumer always gets a real group from `mesh[axis].get_group()` and a
collective on a group of one is a no-op in `plait.comm`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pp", "dp", "cp", "ep", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    tp: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def coords(self, rank: int) -> dict[str, int]:
        """The rank's index along each axis (row-major, tp fastest)."""
        out = {}
        for axis, size in zip(reversed(AXES), reversed(self.shape), strict=True):
            rank, out[axis] = divmod(rank, size)
        return {a: out[a] for a in AXES}

    def rank(self, **coords: int) -> int:
        """Inverse of `coords`; unnamed axes are 0."""
        r = 0
        for axis, size in zip(AXES, self.shape, strict=True):
            r = r * size + coords.get(axis, 0)
        return r

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The global ranks that share every coordinate with `rank` except along `axis`."""
        c = self.coords(rank)
        return [self.rank(**{**c, axis: i}) for i in range(getattr(self, axis))]


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """The world as a 5-D mesh named by `AXES`. Needs an initialised default process group."""
    return init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)
