"""Pipeline parallelism trains what one process trains, for every schedule.

Tolerances as in test_data_parallel: losses relative 1e-5; first-step gradients relative 1e-5,
absolute 1e-8; parameters after 3 steps absolute 1e-5. A pipeline only changes where each layer
runs and the order in which micro-batch gradients are summed: the first step's gradients decide
a schedule's correctness, and 3 optimizer steps (not the helpers' 5) keep the 26 worlds' time
down (the file took 164 s of the suite with 5).
"""

import pytest
import torch
from harness import run_world
from training import assert_params_close, tiny_config, train_here

from plait.comm import Op

STEPS = 3
BASE = ["model.n_layers=8", "train.global_batch=16", f"train.steps={STEPS}"]


@pytest.fixture(scope="module")
def reference():
    return run_world(train_here, 1, tiny_config(*BASE))[0]


def _compare(results, reference):
    ref_losses, ref_val, ref_params, _, _, ref_grads = reference
    for losses, val, params, _, _, grads in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        assert val == pytest.approx(ref_val, rel=1e-5)
        assert params and set(params) <= set(ref_params)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-8, msg=name)
        for name, p in params.items():
            assert_params_close(p, ref_params[name], name, steps=STEPS)
    # Together, the stages hold every parameter exactly once.
    held = [n for _, _, params, *_ in results for n in params]
    return held


CASES = [(sched, P, M) for sched in ("gpipe", "1f1b", "interleaved", "zb1") for P in (2, 4)
         for M in (P, 2 * P, 4 * P)]


@pytest.mark.parametrize("schedule,P,M", CASES)
def test_pipeline_matches_single_process(reference, schedule, P, M):
    cfg = tiny_config(*BASE, f"parallel.pp={P}", "parallel.dp=1",
                      f"parallel.pp_schedule={schedule}", f"parallel.microbatches={M}")
    results = run_world(train_here, P, cfg)
    held = _compare(results, reference)
    assert sorted(held) == sorted(reference[2])
    # Per micro-batch, each chunk boundary carries an activation forward and a gradient backward
    # of (rows, seq, dim) float32; with all rows: 2 * boundaries * 16 * 32 * 64 * 4 bytes. The
    # one collective is the gradient norm for clipping: a float64 all-reduce over pp.
    boundaries = P * (2 if schedule == "interleaved" else 1) - 1
    for _, _, _, (moved, calls, *_), _, _ in results:
        assert calls[Op.ALL_REDUCE] == 1 and set(calls) <= {Op.SEND, Op.RECV, Op.ALL_REDUCE}
    total = sum(r[3][0] for r in results)
    assert total == 2 * boundaries * 16 * 32 * 64 * 4 + P * 2 * (P - 1) / P * 8


@pytest.mark.parametrize("schedule", ["1f1b", "zb1"])
def test_dp2_x_pp2(reference, schedule):
    cfg = tiny_config(*BASE, "parallel.pp=2", "parallel.dp=2", f"parallel.pp_schedule={schedule}",
                      "parallel.microbatches=4")
    results = run_world(train_here, 4, cfg)
    held = _compare(results, reference)
    assert sorted(held) == sorted(2 * list(reference[2]))  # each stage on two dp replicas
