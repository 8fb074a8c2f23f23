"""A user's `ModelPlan` is checked on the model's own modules and weight shapes before anything
is split or communicated (`plan_problem`, run by `plait.prepare` and `plait.estimate`): one line
naming the plan's field, the module and the fix. Before, a swapped split dim failed at the first
step inside a matmul ("mat1 and mat2 shapes cannot be multiplied", a traceback per rank)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.model.plan import ModelPlan, plan_problem

DIM, HIDDEN = 8, 16


class MLP(nn.Module):
    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.up = nn.Linear(DIM, hidden)
        self.down = nn.Linear(hidden, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    """A residual MLP: each block norm -> mlp (the half: up, column-parallel -> gelu -> down,
    row-parallel)."""

    plan = ModelPlan(family="net", blocks="blocks", hidden_size="dim",
                     tp_splits={"mlp.up": 0, "mlp.down": 1}, tp_halves=("mlp",),
                     tp_divides=("hidden",))

    def __init__(self, plan: ModelPlan | None = None):
        super().__init__()
        if plan is not None:
            self.plan = plan
        self.args = SimpleNamespace(dim=DIM, hidden=HIDDEN)
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(2)})

    def forward(self, x):
        for block in self.blocks.values():
            x = block(x)
        return x


def _with(**changes) -> Net:
    return Net(dataclasses.replace(Net.plan, **changes))


def test_a_right_plan_passes():
    assert plan_problem(Net(), 2) is None


@pytest.mark.parametrize("changes,said", [
    (dict(tp_splits={"mlp.up": 1, "mlp.down": 0}),
     "plan.tp_splits['mlp.up'] = 1: blocks.0.mlp.up reads the residual stream (8 wide), which "
     "every tp rank holds whole, so it cannot split its input columns; use 0"),
    (dict(tp_splits={"mlp.up": 0, "mlp.down": 0}),
     "plan.tp_splits['mlp.down'] = 0: blocks.0.mlp.down writes the residual stream (8 wide)"),
    (dict(tp_splits={"mlp.up": 0, "mlp.down": 2}),
     "plan.tp_splits['mlp.down'] = 2: 0 (output rows"),
    (dict(tp_splits={"norm": 0, "mlp.down": 1}),
     "plan.tp_splits['norm']: blocks.0.norm is a LayerNorm, not a linear with a 2-D weight"),
    (dict(blocks="layers"), "plan.blocks: Net has no module container 'layers'"),
    (dict(tp_halves=("ffn",)), "plan: blocks.0 has no module 'ffn' (its modules: mlp, norm)"),
    (dict(tp_splits={"mlp.upp": 0}), "plan.tp_splits: no pattern matches a linear of "
     "blocks.0.mlp, a block half"),
    (dict(tp_divides=("heads",)), "plan.tp_divides: Net.args has no field heads"),
    (dict(first=("embed",)), "plan.first: Net has no attribute 'embed'"),
    (dict(tp_norms=("norm",)), "plan.tp_norms: blocks.0.norm is not an RMSNorm of the block"),
    (dict(tp_heads=("mlp.heads",)), "plan.tp_heads: blocks.0.mlp.heads is not a head count"),
], ids=["swapped-dims", "row-as-column", "dim-2", "not-a-linear", "no-blocks", "no-half",
        "typo", "no-field", "no-first", "norm-not-rms", "no-head-count"])
def test_a_wrong_plan_is_named_in_one_line(changes, said):
    problem = plan_problem(_with(**changes), 2)
    assert problem is not None and problem.startswith(said), problem
    assert "\n" not in problem


def test_a_tp_that_does_not_divide_a_split_weight_is_named():
    net = Net()
    for block in net.blocks.values():
        block.mlp = MLP(hidden=15)
    assert plan_problem(net, 2).startswith(
        "plan.tp_splits['mlp.up']: blocks.0.mlp.up's weight (15, 8) has 15 along dim 0, which "
        "tp=2 does not divide")
    assert plan_problem(net, 1) is None


def test_estimate_refuses_a_wrong_plan_before_tracing():
    """`plait.estimate` (and `plait.prepare`, before its first broadcast) raise the line."""
    x = torch.randn(4, 3, DIM)
    with pytest.raises(ValueError, match=r"^plan.tp_splits\['mlp.up'\] = 1: blocks.0.mlp.up "):
        plait.estimate(_with(tp_splits={"mlp.up": 1, "mlp.down": 0}), (x, x),
                       plait.ParallelConfig(tp=2), world_size=2, loss_fn=F.mse_loss)
