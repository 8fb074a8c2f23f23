"""Data-parallel training equals single-process training on the same global batch.

Tolerances. Ranks sum gradients in a different order than one process does, so results differ in
the last float32 bits (~1e-7 relative):
- losses: relative 1e-5 (docs/design.md, "Predictions and their proof");
- gradients of the first step (same weights on both sides): relative 1e-5, absolute 1e-8. This is
  the check that catches a wrong scale (summing instead of averaging), to which Adam is blind;
- parameters after 5 steps: absolute 1e-5, but for at most 1 element in 1,000 per tensor
  (`training.assert_params_close`). Adam's update g / (sqrt(v) + eps) is close to +-lr for any
  element, so an element whose gradient is at noise level moves by an amount the noise decides,
  which differs between CPUs (we see about one such element in ~10^4); a missed or doubled update
  moves most elements by ~lr = 3e-3.
"""

import pytest
import torch
from harness import run_world
from training import assert_params_close, run_steps, tiny_config, train_here

from plait.comm import Op


@pytest.fixture(scope="module")
def reference():
    return {mb: run_world(train_here, 1, tiny_config(f"parallel.microbatches={mb}"))[0]
            for mb in (1, 2)}


def expected_traffic(algorithm, n, rank, grad_bytes, buckets):
    """(bytes, calls) of one step's gradient reduction, from each algorithm's definition."""
    if algorithm == "backend":  # one all-reduce per bucket, 2 (n - 1) / n of its bytes
        return 2 * (n - 1) * grad_bytes / n, {Op.ALL_REDUCE: buckets}
    if algorithm == "ring":  # 2 (n - 1) sends of D / n per bucket
        steps = 2 * (n - 1) * buckets
        return 2 * (n - 1) * grad_bytes / n, {Op.SEND: steps, Op.RECV: steps}
    if algorithm == "hierarchical":  # 2 nodes of n / 2: within, across (1/2 of it), within
        G, N = n // 2, 2  # the tiny model's buckets hold even numbers of elements: no padding
        moved = 2 * (G - 1) * grad_bytes / G + 2 * (N - 1) * grad_bytes / G / N
        return moved, {Op.REDUCE_SCATTER: buckets, Op.ALL_REDUCE: buckets,
                       Op.ALL_GATHER: buckets}
    if rank == 0:  # naive: the root receives n - 1 buckets and sends the sum n - 1 times
        return (n - 1) * grad_bytes, {Op.SEND: (n - 1) * buckets, Op.RECV: (n - 1) * buckets}
    return grad_bytes, {Op.SEND: buckets, Op.RECV: buckets}


@pytest.mark.parametrize("n,microbatches,algorithm", [
    *[(n, mb, a) for n in (2, 4) for mb in (1, 2) for a in ("backend", "ring", "naive")],
    (4, 2, "hierarchical"),  # 2 nodes of 2 (parallel.ranks_per_node)
])
def test_dp_matches_single_process(reference, n, microbatches, algorithm):
    # 64 KiB buckets: the tiny model's ~490 KiB of gradients travel in several of them.
    cfg = tiny_config(f"parallel.microbatches={microbatches}", f"parallel.allreduce='{algorithm}'",
                      "parallel.bucket_mb=0.0625", f"parallel.ranks_per_node={max(1, n // 2)}")
    ref_losses, ref_val, ref_params, _, grad_bytes, ref_grads = reference[microbatches]
    results = run_world(train_here, n, cfg)
    for losses, val, params, (moved, calls, buckets, rank), _, grads in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        assert val == pytest.approx(ref_val, rel=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-8, msg=name)
        for name, p in params.items():
            assert_params_close(p, ref_params[name], name)
        assert buckets > 4
        assert (moved, calls) == expected_traffic(algorithm, n, rank, grad_bytes, buckets)
    # Replicas stay identical to the bit.
    for _, _, params, *_ in results[1:]:
        for name, p in params.items():
            assert torch.equal(p, results[0][2][name]), name


def test_accumulation_equals_one_big_batch(reference):
    """Splitting each rank's rows into micro-batches changes the summation order only."""
    torch.testing.assert_close(torch.tensor(reference[2][0]), torch.tensor(reference[1][0]),
                               rtol=1e-5, atol=0)


def test_loss_falls():
    losses = run_world(train_here, 2, tiny_config("train.steps=30", "train.warmup_steps=3"))[0][0]
    assert losses[-1] < losses[0] - 1.0, losses


def test_hierarchical_bytes_follow_the_formula():
    """`plait.predict.cost` prices the hierarchical all-reduce as it runs: a step's calls and
    bytes per op equal the formula's (reduce-scatter and all-gather within the 2 nodes of 2,
    the slices' all-reduce across them), and a single node has no across part."""
    for node in (2, 4):
        cfg = tiny_config("parallel.allreduce='hierarchical'", "parallel.bucket_mb=0.0625",
                          f"parallel.ranks_per_node={node}")
        for r in run_world(run_steps, 4, cfg, 2):
            assert r["ledger"] == r["traffic"]
            assert (Op.ALL_REDUCE in r["ledger"][0]) == (node == 2)
