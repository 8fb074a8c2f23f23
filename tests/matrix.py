"""The composition matrix's comparison of a distributed run with one process, shared by the
matrix's files (test_compositions, test_fp16): exact accounting, placements, losses, parameters."""

from __future__ import annotations

from fractions import Fraction

import torch
from training import assert_params_close

from plait.comm import Op
from plait.optim.loss_scaling import HALF
from plait.predict import cost
from plait.train.checks import validate
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


def held(full: torch.Tensor, placement) -> torch.Tensor:
    """This rank's tensor-parallel shard of a one-process tensor (the whole when unsplit)."""
    shard = placement[1].get("tp")
    return full if shard is None else full.chunk(shard.count, dim=shard.dim)[shard.index]


def master_differences(r, ref) -> dict[str, torch.Tensor]:
    """|run - reference| for every element rank `r`'s optimizer steps, per parameter, compared
    where both keep full precision: ZeRO's fp32 masters of bf16/fp16 parameters (the
    parameters themselves otherwise). The half parameters are those masters rounded, so a master
    a hair off a rounding boundary turns into a whole half-precision step of the parameter: 2^-8
    or 2^-7 on a norm gain near 1.0, which alone puts a 64-element tensor's mean difference at
    1.2e-4 per element flipped. How often that happens is the CPU kernels' to decide (AVX2 and
    AVX-512 differ), while the masters differ by summation order alone."""
    out = {}
    for name, pieces in r["masters"].items():
        full = torch.cat([v for _, v in sorted(ref["masters"][name], key=lambda x: x[0])])
        want = held(full.view(ref["params"][name].shape), r["placements"][name]).reshape(-1)
        out[name] = torch.cat([(v - want[s : s + v.numel()]).abs() for s, v in pieces])
    return out


def routed_bytes(cfg, dims, r) -> Fraction:
    """The bytes a rank's token all-to-alls moved in its last step, which follow the routing:
    what the rows each dispatch moved (the expert probe's "rows") say, as in
    test_expert_parallel. Rows go out in the residual's dtype and come back in the experts'
    (half under autocast): the mean of the two per element."""
    half = cfg.train.precision in HALF
    elt = Fraction((2 if cost.half_params(cfg) else 4) + (2 if half else 4), 2)
    return cost.all_to_all_bytes(r["probe"]["rows"], cfg.model.args().dim, elt, dims.ep)


def compare(cfg, results, ref, loss_rtol, param_atol=None, param_mean_atol=None):
    dims = validate(cfg, len(results))
    differences: dict[str, list[torch.Tensor]] = {}
    for r in results:
        # Exact accounting: the last step's collectives and the model state after it equal the
        # formulas of plait.predict.cost, and so does what `plait train --dry-run` predicts for
        # this rank from one process, without a process group.
        dry = describe_rank(cfg, dims, r["rank"])
        if dims.ep > 1:  # the token all-to-alls follow the routing (`routed_bytes`)
            moved = dict(r["traffic"][1])
            moved[Op.ALL_TO_ALL] = moved.get(Op.ALL_TO_ALL, 0) + routed_bytes(cfg, dims, r)
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
        if param_atol is not None:
            for name, p in r["params"].items():
                assert_params_close(p, held(ref["params"][name], r["placements"][name]), name,
                                    atol=param_atol, steps=STEPS)
        else:
            for name, diff in master_differences(r, ref).items():
                differences.setdefault(name, []).append(diff)
    for name, diffs in differences.items():  # over every rank's pieces: a ZeRO slice may hold
        mean = torch.cat(diffs).mean()       # a few elements of a tensor
        assert mean <= param_mean_atol, f"{name}: mean |master - one process| {mean:.2e}"
    assert check_placements(results) == set(ref["params"])  # every parameter held somewhere
