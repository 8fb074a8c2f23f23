"""The parallelisms read a model's plan, not its module names: a model that is not plait's Llama
(a residual MLP with LayerNorms) with a plan of its own trains under tensor parallelism exactly
as the unsharded model does, and a plan that does not fit its model is refused.

Tolerance: outputs and gradients relative 1e-5, absolute 1e-6 (float32; the row-parallel sum of
T partial products is in another order than one matmul's)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_world
from torch import nn

from plait.mesh import Axis
from plait.model.plan import ModelPlan
from plait.parallel.tensor_parallel import apply_tp

DIM, HIDDEN = 8, 16


class MLP(nn.Module):
    def __init__(self, bias: bool = False):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN, bias=bias)
        self.down = nn.Linear(HIDDEN, DIM, bias=bias)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, bias: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = MLP(bias)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class ResidualMLP(nn.Module):
    plan = ModelPlan(family="residual-mlp", blocks="blocks",
                     tp_splits={"mlp.up": 0, "mlp.down": 1}, tp_halves=("mlp",),
                     tp_divides=("hidden",))

    def __init__(self, bias: bool = False):
        super().__init__()
        self.args = SimpleNamespace(hidden=HIDDEN)
        self.inp = nn.Linear(4, DIM)
        self.blocks = nn.ModuleDict({str(i): Block(bias) for i in range(3)})
        self.out = nn.Linear(DIM, 2)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks.values():
            h = block(h)
        return self.out(h)


def _built(bias: bool = False) -> ResidualMLP:
    torch.manual_seed(0)
    return ResidualMLP(bias)


def _tp_equals_one_process(bias: bool):
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    full, model = _built(bias), _built(bias)
    want = full(x)
    want.square().mean().backward()
    split = apply_tp(model, Axis("tp", dist.group.WORLD, rank, size))
    got = model(x)
    got.square().mean().backward()
    grads = {}
    for name, p in model.named_parameters():
        whole = dict(full.named_parameters())[name].grad
        dim = {"up": 0, "down": 1}.get(name.split(".")[-2]) if name in split else None
        grads[name] = (p.grad, whole if dim is None else whole.chunk(size, dim)[rank])
    return got.detach(), want.detach(), grads, split


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "biases"])
def test_a_model_with_its_own_plan_trains_under_tp_as_one_process(bias):
    """With biases: the column-parallel `up` splits its bias with its rows; the row-parallel
    `down` keeps its bias whole and the sum over tp adds it once (Megatron's RowParallelLinear),
    its gradient whole on every rank. Before, such a plan was refused inside each worker."""
    for got, want, grads, split in run_world(_tp_equals_one_process, 2, bias):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        weights = {f"blocks.{i}.mlp.{w}.weight" for i in range(3) for w in ("up", "down")}
        assert split == weights | ({f"blocks.{i}.mlp.up.bias" for i in range(3)} if bias
                                   else set())
        for name, (g, w) in grads.items():
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)


def _refused(plan: ModelPlan) -> str:
    model = _built()
    model.plan = plan
    with pytest.raises((RuntimeError, ValueError)) as e:
        apply_tp(model, Axis("tp", dist.group.WORLD, dist.get_rank(), dist.get_world_size()))
    return str(e.value)


def test_a_plan_that_does_not_fit_its_model_is_refused():
    base = ResidualMLP.plan
    halves = dataclasses.replace(base, tp_halves=("mlp", "norm"))
    divides = dataclasses.replace(base, tp_divides=("odd",))

    def body():
        said = [_refused(halves)]
        model = _built()
        model.args.odd = 3
        model.plan = divides
        with pytest.raises(ValueError) as e:
            apply_tp(model, Axis("tp", dist.group.WORLD, dist.get_rank(), dist.get_world_size()))
        return said + [str(e.value)]

    for said in run_world(body, 2):
        assert said[0].startswith("blocks.0.norm: the plan splits none of its linears"), said[0]
        assert said[1] == "tp=2 must divide odd=3"


def test_a_module_without_a_plan_is_named():
    """At tp = 1 there is nothing to split and no plan is needed; beyond, the degree and the
    module are named."""
    assert apply_tp(nn.Sequential(nn.Linear(2, 2)), Axis.dry("tp", 0, 1)) == set()
    with pytest.raises(ValueError, match="parallel.tp=2 needs a model plan, and Sequential has "
                       "none"):
        apply_tp(nn.Sequential(nn.Linear(2, 2)), Axis.dry("tp", 0, 2))


class NormedMLP(MLP):
    """A half that normalises its hidden units between the two linears: splitting them across
    tp ranks normalises each rank's half alone, which no shape check notices."""

    def forward(self, x):
        h = F.gelu(self.up(x))
        return self.down(F.layer_norm(h, h.shape[-1:]))


def _verified(normed: bool):
    import plait

    plait.init()
    model = _built()
    if normed:
        for block in model.blocks.values():
            block.mlp = NormedMLP()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 2, generator=torch.Generator().manual_seed(2))
    job = plait.prepare(model, F.mse_loss, plait.ParallelConfig(tp=2), verify=True)
    verdict = job.verify(x, y)
    return verdict.failures(), verdict.table()


def test_verify_passes_a_right_plan_and_names_what_a_wrong_one_breaks():
    """`Prepared.verify` (what `plait train --verify` runs): the residual MLP's plan at tp2 is
    within tolerance; the same plan on blocks that normalise inside the split half fails, naming
    the parameter groups whose gradients differ."""
    for failures, table in run_world(_verified, 2, False):
        assert failures == [], table
    for failures, table in run_world(_verified, 2, True):
        assert "blocks.*.mlp.up.weight" in failures and "loss" in failures, table
