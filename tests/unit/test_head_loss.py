"""The cross-entropy fused with the output head (`vocab_parallel.linear_cross_entropy`): the
logits made a run of tokens at a time and never kept, the same loss and gradients as the head's
logits through `F.cross_entropy`. fp32: the same sums in another grouping, within 1e-6 relative;
bf16 (autocast's matmuls, fp32 softmax): within bf16's 2^-8."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.parallel.vocab_parallel import HeadCrossEntropy, linear_cross_entropy


def _case(tokens: int = 37, dim: int = 16, vocab: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, tokens, dim, generator=g, requires_grad=True)
    head = nn.Linear(dim, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, dim, generator=g))
    targets = torch.randint(vocab, (1, tokens), generator=g)
    return hidden, head, targets


def _grads(loss, hidden, head):
    loss.backward()
    out = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    return out


@pytest.mark.parametrize("block", [50, 50 * 8, 50 * 37, 2**24], ids=["1-token runs", "8-token "
                         "runs, the last shorter", "one run exactly", "the default"])
def test_equals_the_heads_logits_through_cross_entropy(block):
    hidden, head, targets = _case()
    want = F.cross_entropy(head(hidden).flatten(0, 1), targets.flatten())
    want_grads = _grads(want, hidden, head)
    got = linear_cross_entropy(hidden, head, targets, block=block)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for g, w in zip(_grads(got, hidden, head), want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_under_autocast_the_matmuls_are_bf16_as_the_heads_would_be():
    hidden, head, targets = _case(tokens=64, dim=32, vocab=96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(head(hidden).flatten(0, 1).float(), targets.flatten())
    want_grads = _grads(want, hidden, head)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(hidden, head, targets, block=96 * 16)
    torch.testing.assert_close(got, want, rtol=2**-8, atol=0)
    for g, w in zip(_grads(got, hidden, head), want_grads, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=2**-7, atol=2**-7 * w.abs().max().item())


def test_a_head_with_a_bias_gets_its_logits_made():
    hidden, _, targets = _case()
    head = nn.Linear(16, 50)
    want = F.cross_entropy(head(hidden).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(HeadCrossEntropy().fused(hidden, head, targets), want)


def test_a_gpu_makes_bigger_runs_and_the_formula_follows_the_device():
    """On a GPU a run holds 2^28 logits (each run re-reads and re-writes the head's whole fp32
    weight gradient: 130-token runs of a 128K vocabulary were half of a 1B model's step on an
    H200); a CPU keeps 2^24. A micro-batch of 1,024 tokens over 128K is then fused on the CPU
    and one unfused run on a GPU, and the activation formula prices each device's own path: the
    GPU's keeps the fp32 softmax (4 bytes a logit), the CPU's a log-sum-exp per token."""
    from plait.config.schema import load_config
    from plait.mesh import ParallelDims
    from plait.parallel.vocab_parallel import fits_one_run, logit_block
    from plait.predict.activations import activation_bytes
    from plait.predict.cost import ChunkLayout

    assert (logit_block("cpu"), logit_block("cuda")) == (2**24, 2**28)
    assert not fits_one_run(1024, 128256, "cpu") and fits_one_run(1024, 128256, "cuda")
    chunks = [ChunkLayout(0, 1, True, True, 0)]
    held = {}
    for device in ("cpu", "cuda"):
        cfg = load_config(None, ["model.preset='tiny'", "model.vocab_size=128256",
                                 "data.seq_len=1024", "train.global_batch=1",
                                 f"train.device='{device}'"])
        held[device] = activation_bytes(cfg, ParallelDims(), chunks)
    # the softmax, less the few bytes per token (log-sum-exp, targets) only the fused path keeps
    assert 4 * 1024 * 128256 - 16 * 1024 < held["cuda"] - held["cpu"] <= 4 * 1024 * 128256


@pytest.mark.parametrize("tokens,dim,vocab,per,dtype,inputs", [
    (512, 64, 1000, 100, torch.float32, torch.float32),  # fp32: the run's product is its logits
    (512, 64, 1000, 100, torch.bfloat16, torch.float32),  # autocast over fp32 weights
    (512, 64, 1000, 100, torch.bfloat16, torch.bfloat16),  # ZeRO's bf16 weights
    (512, 64, 1000, 512, torch.bfloat16, torch.float32),  # one run
    (512, 256, 300, 64, torch.bfloat16, torch.float32),  # wide: the end's casts are the most
    (1000, 32, 5000, 128, torch.bfloat16, torch.float32),  # the last run shorter
])
def test_the_backward_holds_what_backward_bytes_says(tokens, dim, vocab, per, dtype, inputs):
    """`backward_bytes`, which the planner adds to the last stage's peak, against torch's own
    count of the backward's tensors (`MemTracker`, by storage, exact bytes on a CPU). The tracker
    also counts the storages of inputs the backward takes views of (the hidden states and the
    weight where no cast copies them, and the saved log-sum-exp and targets) and of the incoming
    gradient: added below. What the formula leaves out, the runs' index tensors (arange, the
    shifted targets, their mask: 8 + 8 + 1 bytes a token of a run) and the mean's gradient (4
    bytes a token), stay within 32 bytes a token; a term of the formula missing or doubled is
    at least a run's logits (per x vocab x 2 bytes, 12,800 here at the least) or a whole
    matrix."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from plait.parallel.vocab_parallel import LinearCrossEntropy, backward_bytes

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=g).to(inputs).requires_grad_()
    weight = torch.randn(vocab, dim, generator=g).to(inputs).requires_grad_()
    targets = torch.randint(vocab, (tokens,), generator=g)
    loss = LinearCrossEntropy.apply(hidden, weight, targets, dtype, per, None, 0).mean()
    tracker = MemTracker()
    with tracker:
        grads = torch.autograd.grad(loss, (hidden, weight))
    del grads
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    viewed = (inputs == dtype) * (hidden.nbytes + weight.nbytes) + 4 * tokens + 8 * tokens
    size = dtype.itemsize
    want = backward_bytes(tokens, vocab, dim, per, size, inputs.itemsize, inputs.itemsize)
    assert 0 <= measured - viewed - want <= 32 * tokens, (measured - viewed, want)


def test_the_runs_gradient_as_one_pointwise_expression_is_the_in_place_ones():
    """`compiled_kernels` compiles the gradient written as a comparison with each column's index
    (a compiler fuses it into one kernel), not the eager in-place indexed write: the two are the
    same arithmetic, bf16 matmuls and the fp32 softmax, for targets in this rank's rows and (a
    vocabulary-split head's) targets in another's, whose -1 belongs to no column here. Equal to
    bf16's rounding of the same fp32 values (the final cast, 2^-8 relative); a target's -1 in
    the wrong column moves that entry by ~1."""
    from plait.parallel.vocab_parallel import _run_grad_pointwise, run_grad

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 16, generator=g).bfloat16()
    w = torch.randn(30, 16, generator=g).bfloat16()
    t = torch.randint(-10, 40, (40,), generator=g)  # local targets: outside [0, 30) elsewhere
    mine = (t >= 0) & (t < 30)
    lse = torch.logsumexp((x @ w.T).float(), dim=-1)
    grad_loss = torch.rand(40, generator=g)
    want = run_grad(x, w, lse, t, mine, grad_loss)
    got = _run_grad_pointwise(x, w, lse, t, mine, grad_loss)
    assert got.dtype == torch.bfloat16 and 0 < mine.sum() < 40
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-8, atol=1e-6)


def test_compiled_runs_give_the_eager_runs_loss_and_gradients():
    """The fused loss with its per-run arithmetic through torch.compile (`train.compile`; the
    "aot_eager" backend here: dynamo's capture and AOTAutograd, no code generation, which costs
    seconds a graph on a CPU) against the eager runs, the last run shorter (a second graph);
    fp32 matmuls, so within float32's rounding (1e-6 relative: the fp32 softmax in another
    order). `apply_compile` sets a head loss's kernels so."""
    from torch._dynamo.utils import counters

    from plait.parallel.compile import apply_compile
    from plait.parallel.vocab_parallel import compiled_kernels

    hidden, head, targets = _case(tokens=37, dim=16, vocab=50)
    want = linear_cross_entropy(hidden, head, targets, block=50 * 8)
    want_grads = _grads(want, hidden, head)
    before = counters["stats"]["unique_graphs"]
    got = linear_cross_entropy(hidden, head, targets, block=50 * 8,
                               kernels=compiled_kernels("aot_eager"))
    got_grads = _grads(got, hidden, head)
    assert counters["stats"]["unique_graphs"] - before == 4  # each kernel: 8 tokens, then 5
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-8)
    loss = HeadCrossEntropy()
    apply_compile(nn.ModuleDict(), "aot_eager", required=False, loss_fn=loss)
    assert loss.kernels == compiled_kernels("aot_eager")
