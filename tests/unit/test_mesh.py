import itertools

import pytest

from plait.mesh import AXES, ParallelDims, hsdp_rank_lists, node_layout


def test_coords_roundtrip_and_tp_innermost():
    dims = ParallelDims(pp=2, dp=3, cp=1, ep=1, tp=2)
    assert dims.world_size == 12
    seen = set()
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        assert dims.rank(**c) == rank
        seen.add(tuple(c[a] for a in AXES))
    assert seen == set(itertools.product(range(2), range(3), [0], [0], range(2)))
    assert dims.coords(1) == {"pp": 0, "dp": 0, "cp": 0, "ep": 0, "tp": 1}  # tp fastest
    assert dims.coords(6)["pp"] == 1  # pp slowest: the second half of the ranks


def test_group_ranks_partition_the_world():
    dims = ParallelDims(pp=2, dp=2, tp=2)
    for axis in AXES:
        groups = {tuple(dims.group_ranks(axis, r)) for r in range(dims.world_size)}
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(dims.world_size)), axis
        assert all(len(g) == getattr(dims, axis) for g in groups)
    assert dims.group_ranks("tp", 5) == [4, 5]
    assert dims.group_ranks("dp", 5) == [5, 7]
    assert dims.group_ranks("pp", 5) == [1, 5]


@pytest.mark.parametrize("dims,node,layout", [
    (ParallelDims(dp=2, tp=2), 2, "tp2 inside nodes x dp2 across"),
    (ParallelDims(dp=2, tp=2), 1, "tp2 across x dp2 across"),
    (ParallelDims(dp=2, tp=2), 4, "tp2 inside nodes x dp2 inside nodes"),
    (ParallelDims(pp=2, dp=2, tp=2), 4, "tp2 inside nodes x dp2 inside nodes x pp2 across"),
    (ParallelDims(pp=2, dp=4, tp=2), 4, "tp2 inside nodes x dp4 across x pp2 across"),
])
def test_which_axes_stay_inside_a_node(dims, node, layout):
    """A node holds consecutive ranks; tp, innermost, stays inside while it fits."""
    assert node_layout(dims, node) == layout


@pytest.mark.parametrize("dims", [
    ParallelDims(dp=4, dp_shard=2),
    ParallelDims(pp=2, dp=4, tp=2, dp_shard=2),
    ParallelDims(dp=2, cp=2, dp_shard=1),
    ParallelDims(pp=2, dp=4, cp=2, tp=2, dp_shard=2),
    ParallelDims(dp=4, ep=2, dp_shard=2),
    ParallelDims(pp=2, dp=4, ep=2, tp=2, dp_shard=1),
])
def test_hybrid_sharding_groups_hold_their_dp_ranks_cp_and_ep_ranks(dims):
    """Each shard group of the dense parameters is dp_shard dp ranks with all their cp and ep
    ranks (one sequence's ranks never split over two groups), each experts' shard group dp_shard
    dp ranks of one ep rank; each one run of the mesh that the planner prices as `_group_shape`
    says. A replica group takes one rank of each dense shard group, and the ranks of one
    experts' shard group replicate with those of another of the same ep rank, slice for slice
    (the same index in both). Each family partitions the world."""
    from plait.planner.price import _group_shape

    shards, replicas, experts = hsdp_rank_lists(dims)
    for lists, size in ((shards, dims.shard_ranks), (replicas, dims.dp // dims.shard),
                        (experts, dims.shard)):
        assert sorted(r for ranks in lists for r in ranks) == list(range(dims.world_size))
        assert {len(ranks) for ranks in lists} == {size}
    for name, lists in (("dp_shard", shards), ("dp_shard_experts", experts),
                        ("dp_replicate", replicas)):
        stride, size = _group_shape(dims, name)
        assert all(ranks == list(range(ranks[0], ranks[0] + stride * size, stride))
                   for ranks in lists), name
    for ranks in shards:
        coords = [dims.coords(r) for r in ranks]
        assert {(c["cp"], c["ep"]) for c in coords} == \
            {(k, e) for k in range(dims.cp) for e in range(dims.ep)}
        assert len({c["dp"] for c in coords}) == dims.shard
    for ranks in experts:
        assert len({dims.coords(r)["ep"] for r in ranks}) == 1
    shard_of = {r: i for i, ranks in enumerate(shards) for r in ranks}
    index_in = {r: ranks.index(r) for ranks in experts for r in ranks}
    for ranks in replicas:
        assert len({shard_of[r] for r in ranks}) == len(ranks)  # each in another shard group
        assert len({index_in[r] for r in ranks}) == 1  # the same experts' slice
