"""Dropout under a layout (`plait/parallel/dropout.py`, Megatron's RNG-tracker semantics), on a
module from Python with a plan of its own: a residual MLP whose residual stream has a dropout
(replicated over tp) and whose MLP has one between its column- and row-parallel linears (split
over tp), at dp 2 x tp 2.

Asserted, on the masks each rank drew (forward hooks): the replicated region's masks are equal on
the two tp ranks of a dp group and differ between dp groups; the split region's differ between
tp ranks; so the tp ranks' outputs are equal. Activation checkpointing recomputes the masks it
first drew: the step's parameters equal a run without it (1e-6: the same operations in the same
order; different masks would move them by the size of an update). `job.verify` switches dropout
off and says how many it switched off, and then equals one process (its own tolerance)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_world
from torch import nn

import plait
from plait.model.plan import ModelPlan

DIM, HIDDEN, ROWS = 8, 32, 16


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.drop = nn.Dropout(0.5)  # split region: each tp rank holds HIDDEN / tp units
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.down(self.drop(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = MLP()
        self.drop = nn.Dropout(0.5)  # replicated region: the residual stream

    def forward(self, x):
        return self.drop(x + self.mlp(self.norm(x)))


class ResidualMLP(nn.Module):
    plan = ModelPlan(family="residual-mlp-dropout", blocks="blocks",
                     tp_splits={"mlp.up": 0, "mlp.down": 1}, tp_halves=("mlp",),
                     tp_divides=("hidden",))

    def __init__(self):
        super().__init__()
        self.args = SimpleNamespace(hidden=HIDDEN)
        self.inp = nn.Linear(4, DIM)
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(2)})
        self.out = nn.Linear(DIM, 2)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks.values():
            h = block(h)
        return self.out(h)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, 2, generator=g)


def _masks_and_step(checkpointed: bool):
    plait.init()
    torch.manual_seed(0)
    job = plait.prepare(ResidualMLP(), F.mse_loss, plait.ParallelConfig(tp=2, dp=2),
                        checkpoint=plait.WrapPolicy(classes=(Block,)) if checkpointed else None)
    masks: dict[str, list[torch.Tensor]] = {}
    outputs = []
    for name, m in job.parallelized.module.named_modules():
        name = name.partition(".")[2]  # without the pipeline chunk's index
        if isinstance(m, nn.Dropout):
            m.register_forward_hook(lambda m, args, out, name=name: masks.setdefault(
                name, []).append((out == 0) & (args[0] != 0)))
        if name == "out":
            m.register_forward_hook(lambda m, args, out: outputs.append(out.detach()))
    optimizer = torch.optim.SGD(job.parameters(), lr=0.1)
    job.step(_batch(), optimizer)
    params = {n: p.detach().clone() for n, p in job.parallelized.module.named_parameters()}
    return {"rank": dist.get_rank(), "masks": {k: v[0] for k, v in masks.items()},
            "again": {k: v[1:] for k, v in masks.items()}, "out": outputs[0],
            "params": params}


def test_tp_ranks_share_the_replicated_masks_and_split_the_others():
    plain = {r["rank"]: r for r in run_world(_masks_and_step, 4, False)}
    # Ranks: (dp, tp) = (0, 0), (0, 1), (1, 0), (1, 1); tp innermost.
    for dp in (0, 1):
        a, b = plain[2 * dp]["masks"], plain[2 * dp + 1]["masks"]
        for name in ("blocks.0.drop", "blocks.1.drop"):
            assert torch.equal(a[name], b[name]), name
            assert 0.2 < a[name].float().mean() < 0.8, name  # dropout is on
        for name in ("blocks.0.mlp.drop", "blocks.1.mlp.drop"):
            assert not torch.equal(a[name], b[name]), name
        torch.testing.assert_close(plain[2 * dp]["out"], plain[2 * dp + 1]["out"],
                                   rtol=0, atol=0)
    assert not torch.equal(plain[0]["masks"]["blocks.0.drop"], plain[2]["masks"]["blocks.0.drop"])

    recomputed = {r["rank"]: r for r in run_world(_masks_and_step, 4, True)}
    for rank, r in recomputed.items():
        # The split region's dropouts ran again in the backward (a block's last operation,
        # whose output no saved tensor needs, is not: torch's recomputation stops early).
        assert {k: len(v) for k, v in r["again"].items()} == {
            "blocks.0.mlp.drop": 1, "blocks.1.mlp.drop": 1, "blocks.0.drop": 0,
            "blocks.1.drop": 0}
        for name, mask in r["masks"].items():
            assert torch.equal(mask, plain[rank]["masks"][name]), name
            for again in r["again"][name]:
                assert torch.equal(again, mask), name
        for name, p in r["params"].items():
            torch.testing.assert_close(p, plain[rank]["params"][name], rtol=0, atol=1e-6,
                                       msg=name)


def _verified():
    plait.init()
    torch.manual_seed(0)
    job = plait.prepare(ResidualMLP(), F.mse_loss, plait.ParallelConfig(tp=2, dp=2),
                        verify=True)
    verdict = job.verify(*_batch())
    return verdict.dropouts_off, verdict.failures(), verdict.table()


def test_verify_switches_dropout_off_and_says_so():
    for off, failures, table in run_world(_verified, 4):
        assert off == 4 and failures == []
        assert "dropout off for the comparison (4 of the model's dropouts)" in table
