"""Expert parallelism against one process: a mixture-of-experts model (8 experts, top-2, every
block) trained 4 steps on each mesh from the same weights and global batches as a single process.

Tolerances as in the composition matrix (fp32; summation order only): losses relative 1e-5,
parameters absolute 1e-5 but for at most 1 element in 1,000 per tensor
(`training.assert_params_close`): an element whose gradient is at noise level moves differently
under AdamW's normalisation (measured: one embedding element of 8,192 by 6e-5 at ep2 x tp2),
while a missed or doubled update moves most elements by ~lr = 3e-3. The load-balancing loss is
computed per micro-batch over every rank that shares it, so a reference with micro-batches
accumulates the same micro-batches.

Capacity and expert choice route each rank's micro-batch as one routing group (capacity =
ceil(factor * tokens * top_k / E) per group and expert, assignments served first choices first,
then by token position): the reference is the single process with each forward's tokens split
into the same groups (`route_groups` = the ranks that split the batch), which makes the same drops
and so trains the same model.

What equal routing means. Routing is a step function of the router's scores, and the scores of
two layouts are equal only within float tolerance: from step 1 on they differ in the last bits
(gradients summed in another order, then AdamW). Where two tokens' scores tie (identical
contexts: every window that starts with the same byte), the last bit would pick the winner, and
which one it picks depends on the CPU's kernels (measured: an AMD EPYC swapped tokens 99 and 103
of expert 5 at step 1, an Intel AVX-512 machine did not). So the capacity rows check two things
separately: (1) the routing rule, exactly: the single process routes from the very scores the
distributed run computed (gathered from its ranks, `replay`), with its own probabilities as the
gates, and must make the same decisions (which tokens each expert took, per step and layer;
the first step and layer that differ are named); (2) the scores, within float tolerance: the
single process's own scores are within 1e-5 of the distributed run's (4 AdamW steps of lr 3e-3
from the same weights, like every activation here). Given equal decisions, losses and weights are
compared as in every other row. The model's own rule (`plait.model.moe.rank_key`: scores rounded
to 2^-16, then the lower index) keeps such ties ties in any one run.

Accounting: every collective of the last step equals `cost.step_traffic` plus the token
all-to-alls computed from the rows actually routed (`cost.all_to_all_bytes`); model state equals
`cost.state_bytes` (experts sharded over ep count once per ep rank).
"""

from __future__ import annotations

import functools

import pytest
import torch
from harness import run_world
from training import assert_params_close, run_steps, tiny_config

from plait.train.checks import validate
from plait.comm import Op
from plait.predict import cost
from plait.parallel.expert_parallel import moe_layers
from plait.train.dry_run import describe_rank

BASE = ["model.preset='tiny-moe'", "train.warmup_steps=2", "train.steps=4"]


def config(*overrides):
    return tiny_config(*BASE, *overrides)


def probe(route_groups: int = 1, replay=None):
    """Each step's routing (per MoE layer: kept assignments per expert, dropped fraction), the
    token rows this rank's all-to-alls moved in the last step, and each training forward's
    decisions: (step, layer, this rank's share of the batch, its scores, (token, expert) pairs).
    `replay[step][layer]`: scores to route from instead of the layer's own (the gates stay its
    own probabilities)."""

    def install(trainer):
        layers = {n: m for chunk in trainer.model.values() for n, m in moe_layers(chunk).items()}
        steps, decisions, step, now = [], [], trainer.train_step, [0]
        for name, m in layers.items():
            m.route_groups = route_groups
            m.route = functools.partial(_recorded, m.route, name, now, decisions, replay,
                                        trainer.rows_rank)

        def train_step(i):  # the trainer forgets the last step's routing as a step starts
            now[0] = i
            out = step(i)
            steps.append({n: [(s.kept.tolist(), s.dropped) for s in m.stats]
                          for n, m in layers.items()})
            return out

        trainer.train_step = train_step
        return lambda: {
            "routing": steps,
            "decisions": decisions,
            "rows": [r for m in layers.values() for r in getattr(m.dispatch, "rows", [])],
        }

    return install


def _recorded(route, layer, now, decisions, replay, share, probs):
    scores = None if replay is None else replay[now[0]][layer]
    routing = route(probs, scores)
    if torch.is_grad_enabled():  # a training forward
        pairs = sorted(zip(routing.token.tolist(), routing.expert.tolist(), strict=True))
        decisions.append((now[0], layer, share, probs.detach().clone(), pairs))
    return routing


def gathered(results) -> dict:
    """The distributed run's decisions as one process's: {(step, layer): (scores of the whole
    batch, sorted (token, expert) pairs with tokens numbered across the ranks' shares)}."""
    shares: dict = {}
    for r in results:
        for step, layer, share, scores, pairs in r["probe"]["decisions"]:
            shares.setdefault((step, layer), {})[share] = (scores, pairs)
    out = {}
    for key, by_share in shares.items():
        parts = [by_share[i] for i in sorted(by_share)]
        n = len(parts[0][0])
        out[key] = (torch.cat([scores for scores, _ in parts]),
                    sorted((i * n + t, e) for i, (_, pairs) in enumerate(parts) for t, e in pairs))
    return out


def run(ranks, cfg, route_groups=1, replay=None):
    return run_world(run_steps, ranks, cfg, 4, probe(route_groups, replay), timeout=240)


@pytest.fixture(scope="module")
def references():
    return {m: run(1, config(f"parallel.microbatches={m}"))[0] for m in (1, 2)}


def compare(cfg, results, ref, muon: bool = False):
    """`muon`: Muon's tolerances (test_compositions.py's MUON_ROWS say why)."""
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
                                   rtol=1e-4 if muon else 1e-5, atol=0)
        for name, p in r["params"].items():
            shape, shards, replicated = r["placements"][name]
            assert set(shards) | replicated == {"pp", "dp", "cp", "ep", "tp"}, name
            want = ref["params"][name]
            tp = shards.get("tp")
            if tp is not None:
                want = want.chunk(tp.count, dim=tp.dim)[tp.index]
            if muon:
                assert (p - want).abs().mean() <= 1e-4, name
            else:
                assert_params_close(p, want, name, steps=4)
            held.setdefault(name, set()).add(r["coords"]["ep"])
            if ".experts." in name and dims.ep > 1:
                assert "ep" in shards, name
        # Every step's routing per layer is the reference's (each rank sees the global one):
        # assignments kept per expert, fraction of tokens dropped.
        for step, (got, want) in enumerate(zip(r["probe"]["routing"], ref["probe"]["routing"],
                                               strict=True)):
            for name, layer in got.items():
                assert layer == want[name], f"step {step}, layer {name}: routing differs"
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
    # Hybrid sharding: the dense parameters shard over dp_shard dp ranks x ep, the experts over
    # the dp_shard dp ranks of their ep rank; both replicate across the dp / dp_shard groups.
    ("ep2-dp2-hsdp-zero1-shard1", 4, ["parallel.ep=2", "parallel.zero=1",
                                      "parallel.dp_shard=1"]),
    ("ep2-dp4-hsdp-zero3-shard2", 8, ["parallel.ep=2", "parallel.zero=3",
                                      "parallel.dp_shard=2"]),
    # DDP's hierarchical all-reduce on 2 nodes of 2 dp x 2 ep ranks: the dense buckets within
    # the node's 4 ranks, the experts' within its 2 dp ranks of their ep rank; across the nodes.
    ("ep2-dp4-hierarchical", 8, ["parallel.ep=2", "parallel.allreduce='hierarchical'",
                                 "parallel.ranks_per_node=4"]),
]


@pytest.mark.parametrize("ranks,overrides", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_expert_parallel_equals_one_process(references, ranks, overrides):
    cfg = config(*overrides)
    compare(cfg, run(ranks, cfg), references[cfg.parallel.microbatches or 1])


@pytest.mark.kernels
def test_muon_orthogonalizes_each_expert_on_its_ep_rank():
    """Muon (`optim/muon.py`): each expert's matrices whole on their ep rank (split over tp,
    brought together there), the dense ones over dp x ep; the same training as one process."""
    cfg = config("parallel.ep=2", "parallel.tp=2", "train.optimizer='muon'")
    results = run(4, cfg)
    compare(cfg, results, replayed(results, config("train.optimizer='muon'")), muon=True)


def replayed(results, cfg, route_groups: int = 1) -> dict:
    """One process of `cfg` routing every training forward from the distributed run's scores
    (`gathered`), which must make the distributed run's decisions: routing is a step function of
    the scores, and where two layouts' scores are a rounding apart (Muon's bf16 Newton-Schulz
    makes them so from step 1 on) a token near a tie may change expert on one CPU's kernels and
    not on another's (4 tokens on an AVX2-only EPYC, none with AVX-512)."""
    dist = gathered(results)
    replay: dict = {}
    for (step, layer), (scores, _) in dist.items():
        replay.setdefault(step, {})[layer] = scores
    ref = run(1, cfg, route_groups=route_groups, replay=replay)[0]
    own = {(step, layer): pairs for step, layer, _, _, pairs in ref["probe"]["decisions"]}
    assert own.keys() == dist.keys()
    for key in sorted(own):
        assert own[key] == dist[key][1], \
            "step {}, layer {}: the distributed run's experts took other tokens".format(*key)
    return ref


def test_a_pipeline_stage_of_dense_blocks_keeps_its_ep_ranks_as_replicas():
    """MoE every other block on two stages: stage 0 holds only the dense block, its ep ranks
    replicas of it (synchronised over dp x ep like any dense parameter), stage 1 the experts."""
    every = ["model.moe_every=2", "parallel.microbatches=2"]
    cfg = config(*every, "parallel.ep=2", "parallel.pp=2")
    compare(cfg, run(4, cfg), run(1, config(*every))[0])


@pytest.mark.kernels
@pytest.mark.parametrize("ranks,overrides", [
    (4, ["parallel.ep=2", "model.moe_capacity_factor=1.0"]),
    (2, ["parallel.ep=2", "model.moe_router='expert_choice'", "model.moe_capacity_factor=1.0"]),
], ids=["token-choice-capacity-ep2-dp2", "expert-choice-ep2"])
def test_capacity_drops_the_tokens_a_single_process_drops(ranks, overrides):
    """From the distributed run's scores the single process (routing each forward as `ranks`
    groups under the same rule) takes the same tokens per expert and drops the same ones, and its
    own scores are the distributed run's within float tolerance; then losses and weights equal."""
    cfg = config(*overrides)
    results = run(ranks, cfg)
    dist = gathered(results)
    ref = replayed(results, config(*overrides[1:]), route_groups=ranks)  # the decisions first
    own = {(step, layer): (scores, pairs) for step, layer, _, scores, pairs
           in ref["probe"]["decisions"]}
    for key in sorted(own):
        torch.testing.assert_close(own[key][0], dist[key][0], rtol=0, atol=1e-5,
                                   msg=lambda m, key=key: f"step {key[0]}, layer {key[1]}: {m}")
    dropped = [d for step in ref["probe"]["routing"] for layer in step.values() for _, d in layer]
    assert max(dropped) > 0  # the rule bites: some tokens are dropped
    compare(cfg, results, ref)
    if cfg.model.args().moe_router == "expert_choice":
        # Expert choice at capacity 1 routes evenly, as a trace routes fake tokens: the dry
        # run's traced activations are the run's (plait.model.moe's even routing).
        dims = validate(cfg, ranks)
        for r in results:
            dry = describe_rank(cfg, dims, r["rank"])
            assert dry["untraced"] is None
            assert r["activation_bytes"] == dry["activations"]
