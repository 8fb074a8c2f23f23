"""`plait.estimate` on modules plait did not write, against the run itself: for every rank, the
activation bytes (the peak saved for backward, counted by storage as the `activation_bytes`
metric counts it), the FLOPs (torch's `FlopCounterMode` around the real `job.step`), the
collectives (plait's ledger: calls and bus bytes per operation) and the model state after the
step equal what the estimate predicted from one process, on fake tensors, before any process
started. Exact: both sides count the same operations on the same shapes; there is no tolerance.

Models: the example's convolutional classifier with BatchNorm (`examples/digits_zero3.py`), and a
small pre-norm transformer with LayerNorm and learned positions that computes its own loss from
a dict batch (`input_ids`, `labels`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_world
from torch import nn

import plait
from plait.comm import LEDGER
from plait.predict.trace import StepFlops

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
VOCAB, SEQ, WIDTH, BATCH = 64, 16, 32, 8


def _digits_module():
    spec = importlib.util.spec_from_file_location("digits_zero3", EXAMPLES / "digits_zero3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Block(nn.Module):
    """Pre-norm: x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x))."""

    def __init__(self, width: int, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class SmallTransformer(nn.Module):
    """(b, s) token ids -> the mean cross-entropy of predicting `labels` (its own loss)."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tokens(input_ids) + self.positions(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), labels.flatten())


def _case(name: str):
    """(model, global batch, loss_fn) of a named case; "-frozen": with frozen parameters (the
    digits' first block; the transformer's embeddings and first block: under ZeRO-3 by blocks,
    a unit with nothing to gather, and a leftover unit half frozen)."""
    if name.endswith("-frozen"):
        model, batch, loss_fn = _case(name.removesuffix("-frozen"))
        frozen = [model.blocks[0]] + ([model.tokens, model.positions]
                                      if hasattr(model, "tokens") else [])
        for p in (p for m in frozen for p in m.parameters()):
            p.requires_grad_(False)
        return model, batch, loss_fn
    torch.manual_seed(0)
    if name == "digits":
        x = torch.randn(BATCH * 2, 1, 8, 8)
        return _digits_module().DigitsNet(width=8), (x, torch.randint(10, (BATCH * 2,))), \
            F.cross_entropy
    ids = torch.randint(VOCAB, (BATCH, SEQ + 1))
    return SmallTransformer(), {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, None


def _policies(name: str, policy: str) -> dict:
    unit = _digits_module().ConvBlock if name.startswith("digits") else Block
    return {"none": {}, "units": {"wrap": plait.WrapPolicy(classes=(unit,))},
            "by-size": {"wrap": plait.WrapPolicy(min_params=5000)},
            "checkpoint": {"wrap": plait.WrapPolicy(classes=(unit,)),
                           "checkpoint": plait.WrapPolicy(classes=(unit,))}}[policy]


def _measured(name: str, parallel: plait.ParallelConfig, policy: str, precision: str):
    """One real step of the case under `parallel`: this rank's counts."""
    plait.init()
    model, batch, loss_fn = _case(name)
    job = plait.prepare(model, loss_fn, parallel, precision=precision,
                        **_policies(name, policy))
    optimizer = torch.optim.AdamW(job.parameters(), lr=1e-3)
    job.step(batch, optimizer)  # warm: the optimizer's state exists
    LEDGER.reset()
    with job.activations() as counter:  # the public count of what the step saved
        job.step(batch, optimizer)
    ledger = ({op.value: n for op, n in LEDGER.calls.items()}, float(LEDGER.bytes))
    # FLOPs in a step of their own, by torch's FlopCounterMode with its formulas (plait's
    # StepFlops: totals, and the CPU attention kernel counted as torch counts the GPU's).
    with StepFlops() as flops:
        job.step(batch, optimizer)
    return {"rank": torch.distributed.get_rank(), "activation_bytes": counter.peak,
            "flops": flops.get_total_flops(), "ledger": ledger,
            "state": job.state_bytes(optimizer)}


CASES = [
    # (id, model, ranks, ParallelConfig keys, policy, precision)
    ("digits-ddp", "digits", 2, {}, "none", "fp32"),
    ("digits-zero3-units", "digits", 2, {"zero": 3}, "units", "fp32"),
    ("transformer-ddp-accum2", "transformer", 2, {"microbatches": 2}, "none", "fp32"),
    ("transformer-zero2", "transformer", 2, {"zero": 2}, "none", "fp32"),
    ("transformer-zero3-by-size", "transformer", 2, {"zero": 3}, "by-size", "fp32"),
    ("transformer-zero3-checkpoint-bf16", "transformer", 2, {"zero": 3}, "checkpoint", "bf16"),
    # Frozen parameters: whole on every rank, in no flat buffer, no gradient, no state.
    ("digits-zero1-frozen", "digits-frozen", 2, {"zero": 1}, "none", "fp32"),
    ("transformer-ddp-frozen", "transformer-frozen", 2, {}, "none", "fp32"),
    ("transformer-zero3-units-frozen", "transformer-frozen", 2, {"zero": 3}, "units", "fp32"),
]


@pytest.mark.parametrize("name,ranks,keys,policy,precision", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_estimate_equals_the_run(name, ranks, keys, policy, precision):
    parallel = plait.ParallelConfig(**keys)
    model, batch, loss_fn = _case(name)
    predicted = plait.estimate(model, batch, parallel, world_size=ranks, loss_fn=loss_fn,
                               precision=precision, **_policies(name, policy))
    assert [p["rank"] for p in predicted] == list(range(ranks))
    for r in run_world(_measured, ranks, name, parallel, policy, precision, timeout=180):
        p = predicted[r["rank"]]
        assert p["activation_bytes"] == r["activation_bytes"], f"rank {r['rank']}"
        assert p["flops"] == r["flops"], f"rank {r['rank']}"
        # `job.step` also averages the loss it returns over the ranks: one float64 all-reduce,
        # reporting rather than training (the trainer's comm_bytes leaves it out too).
        calls = {**p["comm_calls"], "all_reduce": p["comm_calls"].get("all_reduce", 0) + 1}
        loss_mean = 2 * (ranks - 1) / ranks * 8
        assert (calls, p["comm_bytes"] + loss_mean) == r["ledger"], f"rank {r['rank']}"
        assert p["state"] == r["state"], f"rank {r['rank']}"
        assert p["activation_bytes"] > 0 and p["flops"] > 0


def test_estimate_prices_a_step_on_a_named_gpu():
    """With `gpu`, each rank's step time by the planner's model: compute at the device's rate
    (so a slower device takes longer) plus the communication it cannot hide."""
    model, batch, loss_fn = _case("digits")
    fast, slow = (plait.estimate(model, batch, plait.ParallelConfig(zero=3), world_size=4,
                                 loss_fn=loss_fn, gpu=gpu)[0] for gpu in ("h100", "a100"))
    assert 0 < fast["step_time_s"] < slow["step_time_s"]
    assert fast["comm_bytes"] > 0


def test_estimate_leaves_the_model_as_it_was():
    model, batch, _ = _case("transformer")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plait.estimate(model, batch, plait.ParallelConfig(zero=3), world_size=2)
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not any(p.grad is not None for p in model.parameters())


def test_plan_layouts_prices_every_data_parallel_layout_of_a_module():
    """`plait.plan`: each data-parallel layout the batch allows, priced by `estimate`
    (the row is its fullest rank's state peak plus activations, its slowest rank's step), the
    ones that fit first, fastest first (the lowest ZeRO stage within 2% leading); ZeRO-3 holds
    less than DDP, accumulation keeps less."""
    model, batch, _ = _case("transformer")
    units = _policies("transformer", "units")  # ZeRO-3 gathers a block at a time
    rows = plait.plan(model, batch, gpus=2, gpu="a100", **units)
    layouts = {(r["parallel"].zero, r["parallel"].microbatches) for r in rows}
    assert layouts == {(z, m) for z in range(4) for m in (1, 2, 4)}  # 4 rows per rank
    assert all(r["fits"] for r in rows)
    # Ranked as `plait plan` ranks: the fastest first, except that the lowest ZeRO stage (then
    # the leanest) within 2% of the fastest's throughput leads.
    assert [r["step_time_s"] for r in rows[1:]] == sorted(r["step_time_s"] for r in rows[1:])
    fastest = min(r["step_time_s"] for r in rows)
    near = [r for r in rows if r["step_time_s"] <= fastest / 0.98]
    assert rows[0] is min(near, key=lambda r: (r["parallel"].zero, r["memory_bytes"]))
    by = {(r["parallel"].zero, r["parallel"].microbatches): r for r in rows}
    assert by[3, 1]["memory_bytes"] < by[0, 1]["memory_bytes"]
    assert by[0, 4]["memory_bytes"] < by[0, 1]["memory_bytes"]
    ranks = plait.estimate(model, batch, by[2, 2]["parallel"], world_size=2, gpu="a100",
                           **units)
    assert by[2, 2]["memory_bytes"] == max(r["state"]["peak"] + r["activation_bytes"]
                                           for r in ranks)
    with pytest.raises(ValueError, match="example_batch: 8 rows cannot split over 16 gpus"):
        plait.plan(model, batch, gpus=16, gpu="a100")


class _Numpy(nn.Module):
    """A forward that takes its values out of torch: a fake tensor has none."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(torch.from_numpy(x.numpy()))


def test_python_callers_get_plaits_errors():
    """Bad arguments and untraceable models from Python: one message naming the argument or
    the cause (they were a bare StopIteration, a ZeroDivisionError and torch's numpy error)."""
    from plait.predict.trace import Untraceable

    batch = (torch.randn(4, 4), torch.randint(2, (4,)))
    with pytest.raises(ValueError, match="model: Flatten has no parameters"):
        plait.estimate(nn.Flatten(), batch)
    with pytest.raises(ValueError, match="gpus: a whole number of devices, at least 1; got 0"):
        plait.plan(_Numpy(), batch, gpus=0, gpu="a100")
    with pytest.raises(Untraceable, match=r"outside torch \(.numpy\(\)\)"):
        plait.estimate(_Numpy(), batch, loss_fn=F.cross_entropy)
