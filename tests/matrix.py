"""The composition matrix's comparison of a distributed run with one process, shared by the
matrix's files (test_compositions, test_fp16): exact accounting, placements, losses, parameters."""

from __future__ import annotations

from fractions import Fraction

import torch
from training import assert_params_close

from plait.checks import validate
from plait.comm import Op
from plait.parallel.loss_scaling import HALF
from plait.predict import cost
from plait.train.dry_run import describe_rank

STEPS = 4


def check_placements(results) -> None:
    """Across ranks: each parameter on exactly one pp coordinate, tp shards tiling it."""
    held: dict[tuple, list] = {}
    for r in results:
        c = r["coords"]
        for name, (shape, shards, replicated) in r["placements"].items():
            assert set(shards) | replicated == {"pp", "dp", "cp", "ep", "tp"}, name
            assert not set(shards) & replicated, name
            key = (name, c["dp"], c["cp"], c["ep"])
            held.setdefault(key, []).append((c["pp"], shards.get("tp"), r["params"][name].shape,
                                             shape))
    names = {k[0] for k in held}
    for (name, *_), holders in held.items():
        assert len({pp for pp, *_ in holders}) == 1, f"{name} on several stages"
        tp = holders[0][1]
        if tp is not None:
            assert sorted(h[1].index for h in holders) == list(range(tp.count)), name
            full = holders[0][3]
            assert sum(h[2][tp.dim] for h in holders) == full[tp.dim], name
    return names


def compare(cfg, results, ref, loss_rtol, param_atol=None, param_mean_atol=None):
    dims = validate(cfg, len(results))
    for r in results:
        # Exact accounting: the last step's collectives and the model state after it equal the
        # formulas of plait.predict.cost, and so does what `plait train --dry-run` predicts for
        # this rank from one process, without a process group.
        dry = describe_rank(cfg, dims, r["rank"])
        if dims.ep > 1:  # the token all-to-alls follow the routing: the bytes the rows each
            # dispatch moved (the probe's "rows") say, as in test_expert_parallel
            # Rows go out in the residual's dtype and come back in the experts' (half under
            # autocast): the mean of the two per element.
            half = cfg.train.precision in HALF
            elt = Fraction((2 if half and cfg.parallel.zero else 4) + (2 if half else 4), 2)
            moved = dict(r["traffic"][1])
            moved[Op.ALL_TO_ALL] = moved.get(Op.ALL_TO_ALL, 0) + cost.all_to_all_bytes(
                r["probe"]["rows"], cfg.model.args().dim, elt, dims.ep)
            assert r["ledger"][1] == moved, f"rank {r['rank']}"
        else:
            assert r["ledger"] == r["traffic"], f"rank {r['rank']}"
            assert (dict(dry["traffic"].calls), dry["traffic"].bytes) == r["ledger"]
        assert r["state"] == r["state_formula"], f"rank {r['rank']}"
        assert dry["state"] == r["state"]
        # The activations kept for backward (the step's peak, counted by storage) equal what
        # --dry-run traces of this rank's step on fake tensors (plait.predict.trace), exactly
        # (under token-choice ep they follow the routing, which a trace cannot know).
        assert dims.ep > 1 or dry["activations"] == r["activation_bytes"], f"rank {r['rank']}"
        assert r["activations_left"] == 0, f"rank {r['rank']}"
        assert dry["elements"] == sum(p.numel() for p in r["params"].values()) or \
            cfg.parallel.zero == 3  # ZeRO-3's held_params are gathered whole
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                                   rtol=loss_rtol, atol=0)
        tp = r["placements"]
        for name, p in r["params"].items():
            want = ref["params"][name]
            shard = tp[name][1].get("tp")
            if shard is not None:
                want = want.chunk(shard.count, dim=shard.dim)[shard.index]
            if param_atol is not None:
                assert_params_close(p, want, name, atol=param_atol, steps=STEPS)
            else:
                assert (p.float() - want.float()).abs().mean() <= param_mean_atol, name
    assert check_placements(results) == set(ref["params"])  # every parameter held somewhere
