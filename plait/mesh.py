"""The named device mesh: degrees of (pp, dp, cp, ep, tp) -> a torch `DeviceMesh` over the world.

Axes are laid out row-major in the order of `AXES`, so `tp` is innermost: a tensor-parallel group
is a run of consecutive ranks (one node, on the fastest links), and `pp` is outermost (stages talk
least, point to point, and can cross nodes). Every axis exists in the mesh, with size 1 where the
strategy is off, so a consumer always gets a real group from `mesh[axis].get_group()` and a
collective on a group of one is a no-op in `plait.comm`.

Hybrid sharding (HSDP) splits the `dp` axis further: ranks 0..K-1 of each dp group shard model
state among themselves (`dp_shard`), and the dp / K such groups replicate it (`dp_replicate`).
A shard group of the dense parameters holds its K dp ranks' cp and ep ranks too (K x cp x ep
ranks, a run of the batch axis: the cp ranks of a sequence, the ep ranks whose rows the dense
parameters also see; torchtitan's `dp_shard_cp`); an expert's parameters, on one ep rank, shard
over its K dp ranks alone (`dp_shard_experts`). Both replicate across the same dp / K groups.
`hsdp_groups` builds those families of groups.

A transform receives an `Axis`: the one group it communicates on, with this rank's index and the
axis size. `Axis.dry` describes a coordinate without a process group, so the same transforms can
run on a `meta` model in one process (`plait train --dry-run`). `world_axis` is every rank.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch itself is imported by what builds groups (the command line reads
    # the degrees without it: refusing a bad key takes no second of imports)
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

AXES = ("pp", "dp", "cp", "ep", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    tp: int = 1
    dp_shard: int = 0  # ranks of a dp group that shard model state (HSDP); 0 = all of dp

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        """Ranks that split the batch's rows: dp x ep (expert parallelism's ranks route their own
        tokens, so for the dense parameters they are data-parallel ranks)."""
        return self.dp * self.ep

    @property
    def batch(self) -> int:
        """Ranks that split the batch's tokens, over whose gradients the dense parameters' are
        the mean: dp x cp x ep (rows over dp x ep, each row's sequence over cp)."""
        return self.dp * self.cp * self.ep

    def batch_index(self, coords: dict[str, int]) -> int:
        """A rank's index on the batch axis (dp x cp x ep, row-major: `batch_axis`)."""
        return (coords["dp"] * self.cp + coords["cp"]) * self.ep + coords["ep"]

    @property
    def shard(self) -> int:
        """The dp ranks of a model-state sharding group (dp unless hybrid)."""
        return self.dp_shard or self.dp

    @property
    def hybrid(self) -> bool:
        """Hybrid sharding: the dp ranks shard in groups of `shard` and replicate across them."""
        return self.shard < self.dp

    @property
    def shard_ranks(self) -> int:
        """The ranks of a hybrid sharding group of the dense parameters (`hsdp_groups`): its dp
        ranks' cp and ep ranks too."""
        return self.shard * self.cp * self.ep

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


@dataclass(frozen=True)
class Axis:
    """One mesh axis as a transform sees it: its group (None in a dry run), this rank's index
    along it, and its size."""

    name: str
    group: ProcessGroup | None
    rank: int
    size: int

    @classmethod
    def of(cls, mesh: DeviceMesh, name: str) -> Axis:
        return cls(name, mesh[name].get_group(), mesh[name].get_local_rank(), mesh[name].size())

    @classmethod
    def dry(cls, name: str, rank: int, size: int) -> Axis:
        return cls(name, None, rank, size)


def world_axis() -> Axis:
    """Every rank of the job as one axis, "world": plait's mesh spans the whole job, so its group
    is the default one. The one place plait reads that process-group global; what spans every
    rank (a checkpoint's barriers, a trace's, the broadcast of the step's FLOP count) is handed
    this axis."""
    # here, not at the top: the checks before launch import no torch (tests/unit/test_config.py)
    import torch.distributed as dist

    return Axis("world", dist.group.WORLD, dist.get_rank(), dist.get_world_size())


BATCH_AXES = ("dp", "cp", "ep")  # the data-like axes: each rank a different part of the batch


def rows_share(axes: dict[str, Axis]) -> tuple[int, int]:
    """(this rank's index, ranks) among those that split the batch's rows: dp x ep (the cp ranks
    of a row share it, each holding part of its sequence)."""
    dp, ep = axes["dp"], axes["ep"]
    return dp.rank * ep.size + ep.rank, dp.size * ep.size


def batch_axis(axes: dict[str, Axis]) -> Axis:
    """The dp x cp x ep ranks that share this rank's other coordinates, as one axis "batch"
    (row-major over `BATCH_AXES`): the group over which dense gradients are averaged. It is one
    of those axes when the others have size 1, else a new group (then every rank must call this,
    like `hsdp_groups`)."""
    index, size = 0, 1
    for a in BATCH_AXES:
        index, size = index * axes[a].size + axes[a].rank, size * axes[a].size
    split = [a for a in BATCH_AXES if axes[a].size > 1]
    if len(split) <= 1:
        return Axis("batch", axes[split[0] if split else "dp"].group, index, size)
    if axes["dp"].group is None:
        return Axis.dry("batch", index, size)
    # here, not at the top: the checks before launch import no torch (tests/unit/test_config.py)
    import torch.distributed as dist

    dims = ParallelDims(**{a: dist.get_world_size(axes[a].group) for a in AXES})
    lists = []
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        if all(c[a] == 0 for a in BATCH_AXES):
            lists.append([dims.rank(**{**c, "dp": d, "cp": k, "ep": e}) for d in range(dims.dp)
                          for k in range(dims.cp) for e in range(dims.ep)])
    group, _ = dist.new_subgroups_by_enumeration(lists)
    return Axis("batch", group, index, size)


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """The world as a 5-D mesh named by `AXES`. Needs an initialised default process group."""
    # here, not at the top: the checks before launch import no torch (tests/unit/test_config.py)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)


def hsdp_groups(dims: ParallelDims) -> tuple[Axis, Axis, Axis | None]:
    """(shard, replicate, experts' shard) axes of this rank for hybrid sharding. The dp x cp x
    ep ranks that share this rank's other coordinates, row-major (dp outer: the batch axis), are
    cut into consecutive runs of S = K x cp x ep (K = dims.shard dp ranks, each with its cp and
    ep ranks), which shard the dense parameters; ranks S apart replicate. Under ep the experts
    shard over runs of K of the dp ranks of one ep rank (None without ep), and replicate across
    the same groups (a rank S apart in the batch is K apart in dp, on the same ep rank). Every
    rank must call this (groups are created collectively). With K = dp the replicate axis has
    size 1."""
    # here, not at the top: the checks before launch import no torch (tests/unit/test_config.py)
    import torch.distributed as dist

    S, K, c = dims.shard_ranks, dims.shard, dims.coords(dist.get_rank())
    index = dims.batch_index(c)
    shard_lists, replicate_lists, expert_lists = hsdp_rank_lists(dims)
    shard, _ = dist.new_subgroups_by_enumeration(shard_lists)
    replicate, _ = dist.new_subgroups_by_enumeration(replicate_lists)
    experts = None
    if dims.ep > 1:
        group, _ = dist.new_subgroups_by_enumeration(expert_lists)
        experts = Axis("dp_shard_experts", group, c["dp"] % K, K)
    return (Axis("dp_shard", shard, index % S, S),
            Axis("dp_replicate", replicate, index // S, dims.dp // K), experts)


def hsdp_rank_lists(dims: ParallelDims) -> tuple[list[list[int]], ...]:
    """The ranks of every hybrid sharding group of the dense parameters, of every replica group
    and of every experts' sharding group (`hsdp_groups`)."""
    S, K, shard_lists, replicate_lists, expert_lists = dims.shard_ranks, dims.shard, [], [], []
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        if c["dp"] == c["cp"] == c["ep"] == 0:  # one batch axis per combination of the others
            ranks = [dims.rank(**{**c, "dp": d, "cp": k, "ep": e}) for d in range(dims.dp)
                     for k in range(dims.cp) for e in range(dims.ep)]
            shard_lists += [ranks[i : i + S] for i in range(0, len(ranks), S)]
            replicate_lists += [ranks[i :: S] for i in range(S)]
        if c["dp"] == 0:
            ranks = dims.group_ranks("dp", rank)
            expert_lists += [ranks[i : i + K] for i in range(0, dims.dp, K)]
    return shard_lists, replicate_lists, expert_lists


def ranks_per_node(configured: int, world_size: int) -> int:
    """Processes per node: `parallel.ranks_per_node`, else the launcher's LOCAL_WORLD_SIZE
    (torchrun's and plait's set it), else the whole world (one node)."""
    return configured or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def dp_per_node(dims: ParallelDims, node: int) -> int:
    """The ranks of a dp group on one node: a node of `node` consecutive ranks holds node / (cp x
    ep x tp) consecutive dp coordinates (the axes inside dp are innermost)."""
    return max(1, node // (dims.cp * dims.ep * dims.tp))


def across_nodes(dims: ParallelDims, node: int) -> list[str]:
    """The axes (degree > 1) whose groups span nodes of `node` consecutive ranks."""
    return [a for a in AXES if getattr(dims, a) > 1 and any(
        len({r // node for r in dims.group_ranks(a, rank)}) > 1 for rank in range(dims.world_size))]


def node_layout(dims: ParallelDims, node: int) -> str:
    """Each degree > 1, innermost first, and whether its groups stay inside nodes of `node`
    consecutive ranks or span them: "tp2 inside nodes x dp2 across"."""
    spans = across_nodes(dims, node)
    return " x ".join(f"{a}{getattr(dims, a)} {'across' if a in spans else 'inside nodes'}"
                      for a in reversed(AXES) if getattr(dims, a) > 1) or "one rank"


TP_ACROSS = ("tensor parallelism spans nodes: every block's activations cross the inter-node "
             "link twice per pass; keep tp within a node (tp <= ranks per node)")
