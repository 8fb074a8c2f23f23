"""plait's DDP engine against torch's, and its mechanics: buckets, overlap, no_sync, errors."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import WorldFailed, run_world
from training import assert_params_close
from torch import nn

from plait.comm import LEDGER, Op
from plait.comm.allreduce import AllReduceAlgorithm, NodeGroups, all_reduce_by
from plait.model import PRESETS, build_model
from plait.parallel.engines.ddp import BucketedDataParallel


def _batches(rank, n, steps=5, rows=8, seq=16):
    """The same global batches on every world size; this rank's rows of each."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (rows, seq + 1), generator=g)
        mine = tokens[rank * rows // n : (rank + 1) * rows // n]
        out.append((mine[:, :-1], mine[:, 1:]))
    return out


def _train(wrap):
    """5 AdamW steps of the tiny model wrapped by `wrap(model)`; final parameters."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = build_model(PRESETS["tiny"], seed=0)
    wrapped = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in _batches(rank, n):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(wrapped(x).flatten(0, 1), y.flatten()).backward()
        if hasattr(wrapped, "finish_gradients"):
            wrapped.finish_gradients()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_equals_torch_ddp_on_the_same_data():
    """Tolerance as in test_data_parallel (`training.assert_params_close`): 1e-5 absolute but
    for the elements whose gradients are at noise level under Adam."""

    def both():
        group = dist.group.WORLD
        ours = _train(lambda m: BucketedDataParallel(m, group, bucket_mb=0.0625))
        theirs = _train(lambda m: nn.parallel.DistributedDataParallel(m, process_group=group))
        return ours, theirs

    for ours, theirs in run_world(both, 2):
        for name in ours:
            assert_params_close(ours[name], theirs[name], name, lr=1e-3, steps=5)


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.spare = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def test_a_parameter_without_gradient_is_named_not_a_hang():
    def body():
        ddp = BucketedDataParallel(WithUnused(), dist.group.WORLD)
        ddp(torch.ones(2, 4)).sum().backward()
        ddp.finish_gradients()

    with pytest.raises(WorldFailed, match="no gradient this step: spare.weight, spare.bias"):
        run_world(body, 2, timeout=60)


def _two_linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


def test_no_sync_communicates_nothing_and_accumulates():
    def body():
        model = _two_linears()
        ddp = BucketedDataParallel(model, dist.group.WORLD)
        x = torch.full((1, 8), float(dist.get_rank() + 1))
        LEDGER.reset()
        with ddp.no_sync():
            ddp(x).sum().backward()
        silent = (LEDGER.bytes, sum(LEDGER.calls.values()))
        ddp(x).sum().backward()
        ddp.finish_gradients()
        return silent, dict(LEDGER.calls), {n: p.grad.clone() for n, p in model.named_parameters()}

    # One process: each rank's input twice (two micro-batches), averaged over the 2 ranks.
    reference = _two_linears()
    sum(2 * reference(torch.full((1, 8), float(r + 1))).sum() for r in range(2)).div(2).backward()
    for silent, calls, grads in run_world(body, 2):
        assert silent == (0, 0)
        assert calls == {Op.ALL_REDUCE: 1}  # one bucket, once, after the last micro-batch
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_buckets_launch_during_backward():
    """Overlap: when the last gradient of backward arrives (the input embedding's), the earlier
    buckets' all-reduces are already in flight."""

    def body():
        model = build_model(PRESETS["tiny"], seed=0)
        ddp = BucketedDataParallel(model, dist.group.WORLD, bucket_mb=0.0625)
        seen = []
        model.tok_embeddings.weight.register_hook(lambda g: seen.append(len(ddp._in_flight)))
        x = torch.randint(0, 256, (2, 16))
        ddp(x).sum().backward()
        ddp.finish_gradients()
        return seen[0], len(ddp.buckets), dict(LEDGER.calls)[Op.ALL_REDUCE]

    for in_flight, buckets, calls in run_world(body, 2):
        assert buckets > 4 and calls == buckets
        assert in_flight >= buckets - 2  # all but the embedding's bucket (and maybe one before)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("numel", [1, 7, 12, 1000])
def test_allreduce_algorithms_agree(n, numel):
    """Integer-valued floats sum exactly in any order, so the three must agree to the bit."""

    def body():
        rank = dist.get_rank()
        values = torch.arange(numel, dtype=torch.float32) * (rank + 1) + rank
        nodes = node_groups(n, 2 if n % 2 == 0 else n)  # 3 ranks: one node
        out = {}
        for algorithm in AllReduceAlgorithm:
            t = values.clone()
            all_reduce_by(algorithm, t, dist.group.WORLD, nodes).wait()
            out[algorithm] = t
        return out

    expected = sum(torch.arange(numel, dtype=torch.float32) * (r + 1) + r for r in range(n))
    for out in run_world(body, n):
        for algorithm, t in out.items():
            assert torch.equal(t, expected), algorithm


def node_groups(n: int, G: int) -> NodeGroups:
    """The world's n ranks as n / G nodes of G consecutive ranks."""
    local, _ = dist.new_subgroups_by_enumeration([list(range(i, i + G)) for i in range(0, n, G)])
    across, _ = dist.new_subgroups_by_enumeration([list(range(i, n, G)) for i in range(G)])
    return NodeGroups(local, across)


@pytest.mark.parametrize("n", [2, 4])
def test_allreduce_algorithm_traffic(n):
    """The difference the field talks about: naive funnels (n-1)·D through the root, the ring
    moves 2(n-1)/n·D on every rank. Hierarchical over N = n/2 nodes of G = 2: 2(G-1)/G·D within
    the node (reduce-scatter, all-gather) and 2(N-1)/N·D/G across nodes (the all-reduce of a
    slice), where the ring's rank at a node's edge sends all its 2(n-1)/n·D across."""
    D = 4 * 4096

    def body():
        nodes = node_groups(n, 2)
        moved = {}
        for algorithm in AllReduceAlgorithm:
            LEDGER.reset()
            all_reduce_by(algorithm, torch.ones(4096), dist.group.WORLD, nodes).wait()
            moved[algorithm] = LEDGER.bytes if algorithm is not AllReduceAlgorithm.HIERARCHICAL \
                else dict(LEDGER.bytes_by_op)
        return dist.get_rank(), moved

    G, N = 2, n // 2
    for rank, moved in run_world(body, n):
        assert moved[AllReduceAlgorithm.RING] == 2 * (n - 1) * D / n
        assert moved[AllReduceAlgorithm.BACKEND] == 2 * (n - 1) * D / n
        assert moved[AllReduceAlgorithm.NAIVE] == ((n - 1) * D if rank == 0 else D)
        within = {Op.REDUCE_SCATTER: (G - 1) * D / G, Op.ALL_GATHER: (G - 1) * D / G}
        across = {Op.ALL_REDUCE: 2 * (N - 1) * D / G / N} if N > 1 else {}
        assert moved[AllReduceAlgorithm.HIERARCHICAL] == {**within, **across}


@pytest.mark.parametrize("engine", ["bucketed", "naive"])
def test_replicas_start_from_the_first_ranks_weights(engine):
    from plait.parallel.engines.ddp import NaiveDataParallel

    def body():
        model = build_model(PRESETS["tiny"], seed=dist.get_rank())  # deliberately different
        wrap = BucketedDataParallel if engine == "bucketed" else NaiveDataParallel
        wrap(model, dist.group.WORLD)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    rank0_weights = build_model(PRESETS["tiny"], seed=0).state_dict()
    for params in run_world(body, 3):
        for name, p in params.items():
            assert torch.equal(p, rank0_weights[name]), name
