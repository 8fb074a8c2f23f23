"""Context parallelism against one process: ring attention and Ulysses, alone and composed with
tp (+ sp), dp, pp, ZeRO-3 and activation checkpointing, each trained 4 steps from the same weights
and global batches as a single process (the composition matrix's reference and `compare`: losses
relative 1e-5, parameters absolute 1e-5, the ledger, model state and activations equal to their
formulas on every rank). The tiny model is causal and grouped-query (4 query heads, 2 key/value
heads), so every row runs both.

A forward and backward on the parallelized model is also compared directly: each rank's logits
equal the single process's at that rank's positions, and its gradients after the engine's
reduction equal the single process's (relative 1e-4, absolute 1e-6: fp32, the blockwise softmax
sums in another order than the fused one).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_world
from test_compositions import compare, config
from training import run_steps

from plait.train.checks import validate
from plait.mesh import build_mesh
from plait.model import build_model
from plait.parallel import context_parallel, parallelize

# (id, ranks, overrides): every Done-when row, for both methods where it applies.
ROWS = [
    ("ring-cp2", 2, ["parallel.cp=2"]),
    ("ring-cp4", 4, ["parallel.cp=4"]),
    ("ulysses-cp2", 2, ["parallel.cp=2", "parallel.cp_method=ulysses"]),
    ("ulysses-cp4", 4, ["parallel.cp=4", "parallel.cp_method=ulysses"]),
    ("ring-cp2-tp2", 4, ["parallel.cp=2", "parallel.tp=2"]),
    ("ring-cp2-tp2-sp", 4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("ulysses-cp2-tp2-sp", 4, ["parallel.cp=2", "parallel.tp=2", "parallel.cp_method=ulysses",
                               "parallel.sequence_parallel=true"]),
    ("ring-cp2-dp2", 4, ["parallel.cp=2"]),
    ("ulysses-cp2-dp2-zero1", 4, ["parallel.cp=2", "parallel.cp_method=ulysses",
                                  "parallel.zero=1"]),
    ("ring-cp2-pp2", 4, ["parallel.cp=2", "parallel.pp=2"]),
    ("ulysses-cp2-pp2-zb1", 4, ["parallel.cp=2", "parallel.pp=2", "parallel.cp_method=ulysses",
                                "parallel.pp_schedule=zb1"]),
    ("ring-cp2-zero3", 2, ["parallel.cp=2", "parallel.zero=3"]),
    ("ulysses-cp2-zero3", 2, ["parallel.cp=2", "parallel.zero=3", "parallel.cp_method=ulysses"]),
    ("ring-cp2-dp2-zero2-ac-full", 4, ["parallel.cp=2", "parallel.zero=2",
                                       "train.activation_checkpointing=full"]),
    ("ring-cp2-ac-selective", 2, ["parallel.cp=2", "train.activation_checkpointing=selective"]),
    ("ulysses-cp2-ac-selective", 2, ["parallel.cp=2", "parallel.cp_method=ulysses",
                                     "train.activation_checkpointing=selective"]),
    ("ulysses-cp2-ac-full", 2, ["parallel.cp=2", "parallel.cp_method=ulysses",
                                "train.activation_checkpointing=full"]),
    # Hybrid sharding: a shard group is its dp ranks with their cp ranks (dp_shard=1: the 2 cp
    # ranks of a dp rank shard, the 2 dp ranks replicate; dp_shard=2: 2 dp x 2 cp ranks shard).
    ("ring-cp2-dp2-hsdp-zero3-shard1", 4, ["parallel.cp=2", "parallel.zero=3",
                                           "parallel.dp_shard=1"]),
    ("ulysses-cp2-dp4-hsdp-zero1-shard2", 8, ["parallel.cp=2", "parallel.cp_method=ulysses",
                                              "parallel.zero=1", "parallel.dp_shard=2"]),
    # DDP's hierarchical all-reduce: within a node of 2 dp x 2 cp ranks, across the 2 nodes.
    ("ring-cp2-dp4-hierarchical", 8, ["parallel.cp=2", "parallel.allreduce='hierarchical'",
                                      "parallel.ranks_per_node=4"]),
]


# bf16, against one process of the same precision, with the matrix's bf16 tolerances: the ring's
# blocks are merged in fp32 but each block's output is rounded to bf16 first (the fused kernel's),
# and its key/value blocks travel in bf16.
BF16_ROWS = [
    ("ring-cp2-bf16", 2, ["parallel.cp=2"]),
    ("ulysses-cp2-bf16", 2, ["parallel.cp=2", "parallel.cp_method=ulysses"]),
    ("ring-cp2-dp2-zero1-bf16", 4, ["parallel.cp=2", "parallel.zero=1"]),
]


@pytest.fixture(scope="module")
def reference():
    return run_world(run_steps, 1, config())[0]


@pytest.fixture(scope="module")
def bf16_references():
    return {zero: run_world(run_steps, 1, config("train.precision=bf16",
                                                 f"parallel.zero={zero}"))[0] for zero in (0, 1)}


@pytest.mark.parametrize("ranks,overrides", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_context_parallel_equals_one_process(reference, ranks, overrides):
    cfg = config(*overrides)
    compare(cfg, run_world(run_steps, ranks, cfg, timeout=240), reference, 1e-5, 1e-5)


@pytest.mark.kernels
@pytest.mark.parametrize("ranks,overrides", [r[1:] for r in BF16_ROWS],
                         ids=[r[0] for r in BF16_ROWS])
def test_bf16_context_parallel_tracks_one_process(bf16_references, ranks, overrides):
    cfg = config("train.precision=bf16", *overrides)
    ref = bf16_references[cfg.parallel.zero]
    compare(cfg, run_world(run_steps, ranks, cfg, timeout=240), ref, 1e-3, param_mean_atol=3e-4)


def _forward_backward(cfg):
    """Logits at this rank's positions and gradients after the engine's reduction."""
    dims = validate(cfg, dist.get_world_size())
    model = build_model(cfg.model.args(), cfg.train.seed)
    par = parallelize(model, build_mesh(dims), cfg.parallel)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.args().vocab_size, (2, cfg.data.seq_len + 1),
                           generator=gen)
    x, y = (par.context.shard(t) for t in (tokens[:, :-1], tokens[:, 1:]))
    chunk = par.module[next(iter(par.module))]
    logits = chunk(x)
    par.loss_fn(logits, y).backward()
    par.finish_gradients()
    index = par.context.index(cfg.data.seq_len)
    return index, logits.detach(), {n: p.grad for n, p in par.module.named_parameters()}


@pytest.mark.parametrize("method,fused", [("ring", True), ("ring", False), ("ulysses", True)],
                         ids=["ring", "ring-math-blocks", "ulysses"])
def test_logits_and_gradients_equal_one_process(method, fused, monkeypatch):
    """Also with the ring's blocks computed by `attend_block`'s plain math (off CPU, the path
    every block takes) instead of torch's fused CPU kernel; workers fork with the switch set."""
    monkeypatch.setattr(context_parallel, "FUSED_CPU", fused)
    cfg = config(f"parallel.cp_method={method}")
    _, ref_logits, ref_grads = run_world(_forward_backward, 1, cfg)[0]
    for index, logits, grads in run_world(_forward_backward, 4, config(
            "parallel.cp=4", f"parallel.cp_method={method}")):
        torch.testing.assert_close(logits, ref_logits[:, index], rtol=1e-4, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
