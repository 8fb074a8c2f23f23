"""Gradient compression through the trainer's step path, compared with a one-process simulation of
the same algorithm on the same per-rank gradients (tests/compression_reference.py).

Each row is a layout (DDP, ZeRO-1/2 at dp 2 and 4, ZeRO-3, pp x dp, ep x dp, hybrid sharding,
with gradient accumulation); in one world it trains 3 steps with every method in turn, with compression
starting at step 1 (two compressed steps: the second reduces with what the first held back). A
probe records, for every buffer each rank reduces, what went in (the rank's gradient / n), what
came out (what the optimizer reads) and the ranks of the group it was reduced over (dp; under
ep, dp x ep for the dense buffers and dp for the experts'; under hybrid sharding the replicas,
whose all-reduce of the slices is what is compressed). Then, per group and in call order
(which must be the same on every rank: deterministic collectives), the simulation plays the
group's ranks, keeping their error feedback and PowerSGD's Q across steps, and every rank's
output must equal its result.

Tolerances: int8, top-k and sign decode the same numbers and add them in rank order on every rank
and in the simulation, so they must be equal exactly. fp16 and bf16 are summed by gloo in the
2-byte type in its own order: each partial sum is rounded, so within n roundings of the sum of
magnitudes (2^-10 for fp16, 2^-7 for bf16, each of n ranks). PowerSGD's P and Q are summed by
gloo's fp32 all-reduce in its own order and then orthogonalised: relative 1e-4 of the tensor's
largest value (one wrong rank or a missing error term is off by O(1)).

Also per row and method: the last step's collectives equal `plait.predict.cost`'s formulas, and
the compression state (error feedback, Q) equals its formula.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from compression_reference import Simulation
from harness import run_world
from matrix import routed_bytes
from test_expert_parallel import probe as expert_probe
from training import run_steps, tiny_config

from plait.comm import Op
from plait.config.choices import COMPRESSIONS
from plait.predict import cost
from plait.train.checks import validate

START = 1
BASE = ["train.steps=3", "parallel.bucket_mb=0.05", f"parallel.compression_start={START}",
        "parallel.compression_ratio=0.05", "parallel.compression_rank=2"]
COMPRESSED = [m for m in COMPRESSIONS if m != "none"]
STATELESS = ["fp16", "bf16", "int8"]

LAYOUTS = [
    ("ddp-dp2-accum2", 2, ["parallel.microbatches=2"], COMPRESSED),
    ("ddp-dp4", 4, [], COMPRESSED),
    ("zero1-dp2-accum2", 2, ["parallel.zero=1", "parallel.microbatches=2"], COMPRESSED),
    ("zero1-dp4", 4, ["parallel.zero=1"], COMPRESSED),
    ("zero2-dp2", 2, ["parallel.zero=2"], COMPRESSED),
    ("zero2-dp4-accum2", 4, ["parallel.zero=2", "parallel.microbatches=2"], COMPRESSED),
    ("pp2-dp2-ddp", 4, ["parallel.pp=2"], COMPRESSED),
    ("pp2-dp2-zero2", 4, ["parallel.pp=2", "parallel.zero=2"], COMPRESSED),
    ("zero3-dp2-accum2", 2, ["parallel.zero=3", "parallel.microbatches=2"], STATELESS),
    # Hybrid sharding: the reduce-scatter within the shard group exact, the all-reduce of the
    # slices across the replicas compressed (elementwise methods only).
    ("hsdp-zero2-dp4-shard2", 4, ["parallel.zero=2", "parallel.dp_shard=2"], STATELESS),
    ("hsdp-zero3-dp4-shard2", 4, ["parallel.zero=3", "parallel.dp_shard=2"], STATELESS),
    # Expert parallelism: the dense buffers reduced over dp x ep, the experts' over dp.
    ("ep2-dp2-ddp", 4, ["model.preset='tiny-moe'", "parallel.ep=2"], COMPRESSED),
    ("ep2-dp2-zero1", 4, ["model.preset='tiny-moe'", "parallel.ep=2", "parallel.zero=1"],
     COMPRESSED),
]


class Recorder:
    """Stands in for the engine's method: passes every call through, keeping inputs and outputs."""

    def __init__(self, method, compression):
        self.method, self.compression, self.calls = method, compression, []

    def _record(self, chain, entry, output):
        class Recorded:
            def wait(_):
                chain.wait()
                entry["output"] = output.clone()

        self.calls.append(entry)
        return Recorded()

    def all_reduce(self, key, flat, segments, group):
        entry = self._entry(key, flat, segments, False, group)
        return self._record(self.method.all_reduce(key, flat, segments, group), entry, flat)

    def reduce_scatter(self, key, flat, out, segments, group):
        entry = self._entry(key, flat, segments, True, group)
        chain = self.method.reduce_scatter(key, flat, out, segments, group)
        return self._record(chain, entry, out)

    def _entry(self, key, flat, segments, sharded, group):
        return {"step": self.compression.steps, "key": key, "input": flat.clone(),
                "segments": segments, "sharded": sharded,
                "ranks": tuple(dist.get_process_group_ranks(group))}

    def __getattr__(self, name):
        return getattr(self.method, name)


def record_compression(trainer):
    """The compression's calls; under ep also the token rows the all-to-alls moved (their bytes
    follow the routing: `test_expert_parallel.probe`)."""
    compression = trainer.parallelized.engine.compression
    recorder = Recorder(compression.method, compression)
    compression.method = recorder
    routed = expert_probe()(trainer) if trainer.dims.ep > 1 else lambda: {}
    return lambda: {"calls": recorder.calls, "state": compression.state_bytes(), **routed()}


def run_methods(overrides, methods):
    return {m: run_steps(tiny_config(*BASE, *overrides, f"parallel.compression={m}"),
                         probe=record_compression)
            for m in methods}


def check_against_simulation(method, results, dims, tolerance) -> set[int]:
    """Per group of ranks a buffer was reduced over (dp; dp x ep for the dense buffers and dp
    for the experts' under ep), its members in group order; returns the groups' sizes."""
    groups: dict[tuple, dict] = {}
    for r in results:
        for call in r["probe"]["calls"]:
            groups.setdefault(call["ranks"], {}).setdefault(r["rank"], []).append(call)
    for ranks, members in groups.items():
        calls = [members[rank] for rank in ranks]
        n = len(calls)
        # Same buffers in the same order on every rank; none before compression starts.
        order = [[(c["step"], c["key"]) for c in rank_calls] for rank_calls in calls]
        assert all(o == order[0] for o in order), "ranks reduced buffers in different orders"
        assert order[0] and min(step for step, _ in order[0]) == START
        sim = Simulation(method, n, ratio=0.05, rank=2)
        for i in range(len(calls[0])):
            first = calls[0][i]
            want = sim.reduce(first["key"], [c[i]["input"] for c in calls], first["segments"],
                              first["sharded"])
            for dp, rank_calls in enumerate(calls):
                got = rank_calls[i]["output"].float()
                expected = want.chunk(n)[dp] if first["sharded"] else want
                tolerance(method, got, expected, [c[i]["input"] for c in calls], dp)
    return {len(ranks) for ranks in groups}


def tolerance(method, got, expected, inputs, dp):
    if method in ("int8", "topk", "sign"):
        assert torch.equal(got, expected), f"{method}: rank {dp} differs from the simulation"
        return
    if method == "powersgd":
        scale = expected.abs().max().clamp_min(1e-30)
        assert (got - expected).abs().max() <= 1e-4 * scale, method
        return
    eps = {"fp16": 2.0**-10, "bf16": 2.0**-7}[method]
    magnitude = torch.stack([x.float().abs() for x in inputs]).sum(0)
    if got.numel() != magnitude.numel():  # a ZeRO slice
        magnitude = magnitude.chunk(len(inputs))[dp]
    assert ((got - expected).abs() <= len(inputs) * eps * magnitude + 1e-12).all(), method


@pytest.mark.parametrize("ranks,overrides,methods", [r[1:] for r in LAYOUTS],
                         ids=[r[0] for r in LAYOUTS])
def test_compressed_reduction_equals_simulation(ranks, overrides, methods):
    results = run_world(run_methods, ranks, overrides, methods, timeout=240)
    for method in methods:
        per_rank = [r[method] for r in results]
        cfg = tiny_config(*BASE, *overrides, f"parallel.compression={method}")
        dims = validate(cfg, ranks)
        sizes = check_against_simulation(method, per_rank, dims, tolerance)
        assert sizes == ({dims.dp // dims.shard} if dims.hybrid else  # the replicas
                         {dims.dp * dims.ep, dims.dp} - {1}), sizes  # under ep: both kinds
        for r in per_rank:
            assert _ledger(r, cfg, dims) == r["traffic"][1], \
                f"{method} rank {r['rank']}: bytes != formula"
            assert r["state"] == r["state_formula"], f"{method} rank {r['rank']}"
            assert r["state"]["compression"] == r["probe"]["state"]
            assert (r["state"]["compression"] > 0) == (method not in STATELESS)


def _ledger(r, cfg, dims) -> dict:
    """The bytes the step moved per op, less (under ep) the token all-to-alls', which the
    routing decides (`matrix.routed_bytes`); with dp alone also the calls, which must equal
    the formulas'."""
    moved = dict(r["ledger"][1])
    if dims.ep == 1:
        assert r["ledger"][0] == r["traffic"][0], f"rank {r['rank']}: calls != formula"
        return moved
    moved[Op.ALL_TO_ALL] -= routed_bytes(cfg, dims, r)
    return {op: b for op, b in moved.items() if b}


def train_losses(methods, steps):
    return {m: run_steps(tiny_config(f"train.steps={steps}", f"parallel.compression={m}"),
                         steps=steps)["losses"] for m in methods}


def test_two_byte_reductions_train_like_fp32():
    """fp16 and bf16 change only the rounding of the mean gradient (2^-11, 2^-8 relative), which
    AdamW's normalised update barely feels: over 20 steps the losses stay within 1e-2 of
    uncompressed training (a wrong scale or a lost bucket moves them by far more)."""
    losses = run_world(train_losses, 2, ["none", "fp16", "bf16"], 20, timeout=240)[0]
    for method in ("fp16", "bf16"):
        gap = max(abs(a - b) for a, b in zip(losses[method], losses["none"], strict=True))
        assert gap < 1e-2, (method, gap)
    assert losses["none"][-1] < losses["none"][0] - 0.5  # it trained
