"""A 32K vocabulary: the last pipeline stage never holds the logits whole. Its measured peak of
what a step keeps for backward (`activation_bytes`, counted by storage) equals the formula of
`predict.activations` for the cross-entropy fused with the head (a log-sum-exp per token, not the
fp32 softmax of 32,768 logits per token), on a pp2 run whose micro-batch of 1,024 tokens goes
through the loss in two runs of 512; and the run trains as one process does (the composition
matrix's comparison: losses, parameters, collectives, state)."""

from __future__ import annotations

from harness import run_world
from matrix import compare
from training import run_steps, tiny_config

from plait.train.checks import validate
from plait.config.schema import microbatches
from plait.mesh import AXES, Axis, batch_axis
from plait.model import build_configured
from plait.parallel import place
from plait.predict import cost
from plait.predict.activations import activation_bytes

VOCAB = 32768
BASE = ["model.n_layers=2", f"model.vocab_size={VOCAB}", "data.seq_len=64",
        "train.global_batch=32", "train.steps=4", "train.warmup_steps=2"]


def _formula(cfg, dims, rank: int) -> int:
    coords = dims.coords(rank)
    axes = {a: Axis.dry(a, coords[a], getattr(dims, a)) for a in AXES}
    axes["batch"] = batch_axis(axes)
    model = build_configured(cfg.model.args(), cfg.train.seed, "meta")
    chunks, _, _ = place(model, axes, cfg.parallel, microbatches(cfg.parallel, dims))
    return activation_bytes(cfg, dims, cost.chunk_layouts(chunks))


def test_the_last_stage_keeps_no_logits():
    cfg = tiny_config(*BASE, "parallel.pp=2")
    dims = validate(cfg, 2)
    results = run_world(run_steps, 2, cfg, timeout=240)
    compare(cfg, results, run_world(run_steps, 1, tiny_config(*BASE))[0], 1e-5, 1e-5)
    tokens = 32 // 2 * 64  # a micro-batch: 16 rows of 64
    for r in results:
        assert r["activation_bytes"] == _formula(cfg, dims, r["rank"])
    last = results[1]["activation_bytes"]
    assert last < 4 * tokens * VOCAB // 8  # an eighth of one micro-batch's fp32 logits
