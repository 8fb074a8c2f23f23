"""Expert parallelism against one process: a mixture-of-experts model (8 experts, top-2, every
block) trained 4 steps on each mesh from the same weights and global batches as a single process.

Tolerances as in the composition matrix (fp32; summation order only): losses relative 1e-5,
parameters absolute 5e-5: an element whose gradient is at noise level moves differently under
AdamW's normalisation (measured: one embedding element by 2e-5 at ep2 x tp2), while a missed or
doubled update moves every element by ~lr = 3e-3. The load-balancing loss is computed per micro-batch over every rank
that shares it, so a reference with micro-batches accumulates the same micro-batches.

Capacity and expert choice route each rank's micro-batch as one routing group (capacity =
ceil(factor * tokens * top_k / E) per group and expert, assignments served first choices first,
then by token position): the reference is the single process with each forward's tokens split
into the same groups (`route_groups` = the ranks that split the batch), which makes the same drops
and so trains the same model.

Accounting: every collective of the last step equals `cost.step_traffic` plus the token
all-to-alls computed from the rows actually routed (`cost.all_to_all_bytes`); model state equals
`cost.state_bytes` (experts sharded over ep count once per ep rank).
"""

from __future__ import annotations

import pytest
import torch
from harness import run_world
from training import run_steps, tiny_config

from plait.checks import validate
from plait.comm import Op
from plait.parallel import cost
from plait.parallel.expert_parallel import moe_layers
from plait.train.dry_run import describe_rank

BASE = ["model.preset='tiny-moe'", "train.warmup_steps=2", "train.steps=4"]


def config(*overrides):
    return tiny_config(*BASE, *overrides)


def probe(route_groups: int = 1):
    """Each step's routing (per MoE layer: kept assignments per expert, dropped fraction) and
    the token rows this rank's all-to-alls moved in the last step."""

    def install(trainer):
        layers = [m for chunk in trainer.model.values() for m in moe_layers(chunk).values()]
        steps, step = [], trainer.train_step
        for m in layers:
            m.route_groups = route_groups

        def train_step(i):  # the trainer forgets the last step's routing as a step starts
            out = step(i)
            steps.append({id(m): [(s.kept.tolist(), s.dropped) for s in m.stats]
                          for m in layers})
            return out

        trainer.train_step = train_step
        names = {id(m): n for chunk in trainer.model.values()
                 for n, m in moe_layers(chunk).items()}
        return lambda: {
            "routing": [{names[k]: v for k, v in s.items()} for s in steps],
            "rows": [r for m in layers for r in getattr(m.dispatch, "rows", [])],
        }

    return install


def run(ranks, cfg, route_groups=1):
    return run_world(run_steps, ranks, cfg, 4, probe(route_groups), timeout=240)


@pytest.fixture(scope="module")
def references():
    return {m: run(1, config(f"parallel.microbatches={m}"))[0] for m in (1, 2)}


def compare(cfg, results, ref):
    dims = validate(cfg, len(results))
    args = cfg.model.args()
    act_b = 2 if cfg.train.precision == "bf16" and cfg.parallel.zero else 4
    held = {}
    for r in results:
        calls, moved = r["ledger"]
        formula = dict(r["traffic"][1])
        tokens = cost.all_to_all_bytes(r["probe"]["rows"], args.dim, act_b, dims.ep)
        if tokens:
            formula[Op.ALL_TO_ALL] += tokens
        assert moved == formula, f"rank {r['rank']}"
        assert r["state"] == r["state_formula"], f"rank {r['rank']}"
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=0)
        for name, p in r["params"].items():
            shape, shards, replicated = r["placements"][name]
            assert set(shards) | replicated == {"pp", "dp", "cp", "ep", "tp"}, name
            want = ref["params"][name]
            tp = shards.get("tp")
            if tp is not None:
                want = want.chunk(tp.count, dim=tp.dim)[tp.index]
            torch.testing.assert_close(p, want, rtol=0, atol=5e-5, msg=name)
            held.setdefault(name, set()).add(r["coords"]["ep"])
            if ".experts." in name and dims.ep > 1:
                assert "ep" in shards, name
        # Every step's routing per layer is the reference's (each rank sees the global one):
        # assignments kept per expert, fraction of tokens dropped.
        for step, want in zip(r["probe"]["routing"], ref["probe"]["routing"], strict=True):
            for name, layer in step.items():
                assert layer == want[name], name
    assert held.keys() == ref["params"].keys()  # every expert held somewhere
    for name, coords in held.items():  # an expert on one ep rank, the rest on all
        assert len(coords) == (1 if ".experts." in name else dims.ep), name


ROWS = [
    ("ep2", 2, ["parallel.ep=2"]),
    ("ep4", 4, ["parallel.ep=4"]),
    ("ep2-dp2", 4, ["parallel.ep=2"]),
    ("ep2-tp2", 4, ["parallel.ep=2", "parallel.tp=2"]),
    ("ep2-tp2-sp", 4, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("ep2-pp2", 4, ["parallel.ep=2", "parallel.pp=2", "parallel.microbatches=2"]),
    ("ep2-dp2-zero1", 4, ["parallel.ep=2", "parallel.zero=1"]),
    ("ep2-dp2-zero2-selective", 4, ["parallel.ep=2", "parallel.zero=2",
                                    "train.activation_checkpointing=selective"]),
    ("ep2-pp2-tp2-zero1", 8, ["parallel.ep=2", "parallel.pp=2", "parallel.tp=2",
                              "parallel.zero=1", "parallel.microbatches=2"]),
    ("ep2-dp2-zero3-ac", 4, ["parallel.ep=2", "parallel.zero=3",
                             "train.activation_checkpointing=full"]),
]


@pytest.mark.parametrize("ranks,overrides", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_expert_parallel_equals_one_process(references, ranks, overrides):
    cfg = config(*overrides)
    compare(cfg, run(ranks, cfg), references[cfg.parallel.microbatches or 1])


@pytest.mark.parametrize("ranks,overrides", [
    (4, ["parallel.ep=2", "model.moe_capacity_factor=1.0"]),
    (2, ["parallel.ep=2", "model.moe_router='expert_choice'", "model.moe_capacity_factor=1.0"]),
], ids=["token-choice-capacity-ep2-dp2", "expert-choice-ep2"])
def test_capacity_drops_the_tokens_a_single_process_drops(ranks, overrides):
    """The reference routes each forward as `ranks` groups under the same rule: same drops."""
    cfg = config(*overrides)
    ref = run(1, config(*overrides[1:]), route_groups=ranks)[0]
    dropped = [d for step in ref["probe"]["routing"] for layer in step.values() for _, d in layer]
    assert max(dropped) > 0  # the rule bites: some tokens are dropped
    results = run(ranks, cfg)
    compare(cfg, results, ref)
    if cfg.model.args().moe_router == "expert_choice":
        # Expert choice at capacity 1 routes evenly: the activations are the formula's, which
        # assumes that (plait.parallel.activations.moe_extra_bytes).
        dims = validate(cfg, ranks)
        for r in results:
            assert r["activation_bytes"] == describe_rank(cfg, dims, r["rank"])["activations"]
