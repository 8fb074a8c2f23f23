"""Every accounted collective: right values, and bytes equal to the ring-convention formulas.

The expected bytes are written out from docs/design.md's convention here, independently of
`plait.comm.bus_bytes`, so a wrong formula in the library cannot agree with itself.
"""

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from harness import WorldFailed, run_world

from plait import comm
from plait.comm import LEDGER, Op
from plait.mesh import ParallelDims, build_mesh

ELEMS = 12  # divisible by 1, 2, 3, 4: chunks are whole


def _exercise_collectives():
    """Runs each collective on the world group; returns (values seen, ledger after each op)."""
    world, rank, n = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    seen, booked = {}, {}

    def book(name):
        booked[name] = (LEDGER.bytes, dict(LEDGER.calls))
        LEDGER.reset()

    LEDGER.reset()
    t = torch.full((ELEMS,), float(rank + 1))
    comm.all_reduce(t, world)
    seen["all_reduce"] = t.clone()
    book("all_reduce")

    out = torch.empty(ELEMS * n)
    comm.all_gather(out, torch.full((ELEMS,), float(rank)), world)
    seen["all_gather"] = out
    book("all_gather")

    full = torch.arange(ELEMS * n, dtype=torch.float32) * (rank + 1)
    shard = torch.empty(ELEMS)
    comm.reduce_scatter(shard, full, world)
    seen["reduce_scatter"] = shard
    book("reduce_scatter")

    b = torch.full((ELEMS,), float(rank))
    comm.broadcast(b, src=n - 1, group=world)
    seen["broadcast"] = b
    book("broadcast")

    # Row i of this rank's input goes to rank i; we receive row `rank` of everyone.
    a2a_in = torch.tensor([[100.0 * rank + dst] * 3 for dst in range(n)])  # (n, 3)
    a2a_out = torch.empty_like(a2a_in)
    comm.all_to_all(a2a_out, a2a_in, world)
    seen["all_to_all"] = a2a_out
    book("all_to_all")

    # A ring of point-to-point messages, async: send right, receive from the left.
    msg, got = torch.full((ELEMS,), float(rank)), torch.empty(ELEMS)
    if n > 1:
        pending = [comm.send(msg, (rank + 1) % n, world, async_op=True),
                   comm.recv(got, (rank - 1) % n, world, async_op=True)]
        for p in pending:
            p.wait()
        seen["ring"] = got
    book("p2p")

    work = comm.all_reduce(torch.ones(ELEMS), world, async_op=True)
    work.wait()
    book("async_all_reduce")
    return rank, n, seen, booked


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_values_and_bytes(n):
    D = ELEMS * 4  # bytes of one fp32 tensor of ELEMS elements
    for rank, n_, seen, booked in run_world(_exercise_collectives, n):
        assert n_ == n
        assert torch.equal(seen["all_reduce"], torch.full((ELEMS,), n * (n + 1) / 2))
        assert torch.equal(seen["all_gather"], torch.arange(n).repeat_interleave(ELEMS).float())
        expect_rs = (torch.arange(ELEMS * n).float() * n * (n + 1) / 2)[
            rank * ELEMS : (rank + 1) * ELEMS]
        assert torch.equal(seen["reduce_scatter"], expect_rs)
        assert torch.equal(seen["broadcast"], torch.full((ELEMS,), float(n - 1)))
        assert torch.equal(seen["all_to_all"][:, 0], torch.arange(n) * 100.0 + rank)
        assert torch.equal(seen["ring"], torch.full((ELEMS,), float((rank - 1) % n)))

        # Bytes per rank, docs/design.md: all-reduce 2(n-1)/n D; all-gather / reduce-scatter
        # (n-1)/n of the full tensor; all-to-all (n-1)/n D; broadcast and send D.
        assert booked["all_reduce"] == (Fraction(2 * (n - 1) * D, n), {Op.ALL_REDUCE: 1})
        assert booked["all_gather"] == (Fraction((n - 1) * D * n, n), {Op.ALL_GATHER: 1})
        assert booked["reduce_scatter"] == (Fraction((n - 1) * D * n, n), {Op.REDUCE_SCATTER: 1})
        assert booked["broadcast"] == (Fraction(D), {Op.BROADCAST: 1})
        a2a_bytes = n * 3 * 4
        assert booked["all_to_all"] == (Fraction((n - 1) * a2a_bytes, n), {Op.ALL_TO_ALL: 1})
        assert booked["p2p"] == (Fraction(D), {Op.SEND: 1, Op.RECV: 1})
        assert booked["async_all_reduce"][0] == Fraction(2 * (n - 1) * D, n)


def _in_place_against_gloo():
    """plait's paths for big CPU tensors on gloo (n broadcasts; an all-reduce of the caller's
    scratch) against gloo's own all-gather and reduce-scatter on the same inputs."""
    from plait.comm.collectives import IN_PLACE, _in_place

    world, rank, n = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    numel = IN_PLACE // 4 // n + 5  # an fp32 shard a little over 1/n of the threshold
    torch.manual_seed(rank)
    shard = torch.randn(numel)
    full = torch.randn(numel * n)
    ours, theirs = torch.empty(numel * n), torch.empty(numel * n)
    LEDGER.reset()
    comm.all_gather(ours, shard, world, async_op=True).wait()
    dist.all_gather_into_tensor(theirs, shard, group=world)
    mine, expect = torch.empty(numel), torch.empty(numel)
    dist.reduce_scatter_tensor(expect, full, group=world)
    comm.reduce_scatter(mine, full, world, async_op=True, scratch=True).wait()
    small = torch.empty(4 * n)
    return (_in_place(ours, world), _in_place(small, world), torch.equal(ours, theirs),
            torch.equal(mine, expect), dict(LEDGER.calls), LEDGER.bytes, numel * n * 4)


def test_big_gloo_collectives_in_place_equal_gloo():
    for in_place, small_too, gathered, reduced, calls, moved, D in run_world(
            _in_place_against_gloo, 3):
        assert in_place and not small_too
        assert gathered and reduced  # bit for bit: the same all-reduce, the same bytes
        assert calls == {Op.ALL_GATHER: 1, Op.REDUCE_SCATTER: 1}
        assert moved == 2 * Fraction(2 * D, 3)  # one all-gather and one reduce-scatter


def test_group_of_one_is_a_noop():
    def body():
        solo = dist.new_group([dist.get_rank()])  # every rank makes the same calls, in order
        others = dist.new_group([1 - dist.get_rank()])
        del others
        LEDGER.reset()
        t = torch.full((4,), 3.0)
        comm.all_reduce(t, solo)
        out = torch.empty(4)
        comm.all_gather(out, t, solo)
        return t, out, LEDGER.bytes, sum(LEDGER.calls.values())

    for t, out, moved, calls in run_world(body, 2):
        assert torch.equal(t, torch.full((4,), 3.0)) and torch.equal(out, t)
        assert moved == 0 and calls == 0


def test_mesh_groups_follow_axis_order():
    """dp=2 x tp=2 on 4 ranks: tp groups are consecutive ranks, dp groups stride by tp."""

    def body():
        dims = ParallelDims(dp=2, tp=2)
        mesh = build_mesh(dims)
        rank = dist.get_rank()
        groups = {}
        for axis in ("dp", "tp", "pp"):
            t = torch.tensor([float(rank)])
            comm.all_reduce(t, mesh[axis].get_group())
            groups[axis] = (t.item(), mesh[axis].get_local_rank())
        return rank, groups, dims.group_ranks("tp", rank), dims.group_ranks("dp", rank)

    for rank, groups, tp_ranks, dp_ranks in run_world(body, 4):
        assert tp_ranks == [rank - rank % 2, rank - rank % 2 + 1]
        assert dp_ranks == [rank % 2, rank % 2 + 2]
        assert groups["tp"] == (sum(tp_ranks), rank % 2)
        assert groups["dp"] == (sum(dp_ranks), rank // 2)
        assert groups["pp"] == (rank, 0)


def test_failing_rank_reports_its_traceback_instead_of_hanging():
    def body():
        if dist.get_rank() == 1:
            raise ValueError("rank one gives up")
        comm.all_reduce(torch.ones(1), dist.group.WORLD)  # would wait forever for rank 1

    with pytest.raises(WorldFailed, match="(?s)rank 1 of 2 failed.*ValueError: rank one gives up"):
        run_world(body, 2, timeout=60)
