"""plait's SwiGLU feed-forward never keeps its gate (`model/feed_forward.GatedDown`): the same
output and gradients as autograd through w2(silu(w1 x) * w3 x), bit for bit (the backward runs
autograd's own operations in its order), in fp32 and under bf16 autocast, and two tensors of
the hidden size fewer kept for backward; under torch.compile, the plain composition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.model.args import model_args
from plait.model.feed_forward import FeedForward


def _reference(ff: FeedForward, x: torch.Tensor) -> torch.Tensor:
    return ff.w2(F.silu(ff.w1(x)) * ff.w3(x))


def _run(ff, x, forward, autocast: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = forward(ff, x)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    gx, *gw = torch.autograd.grad(out, (x, ff.w1.weight, ff.w3.weight, ff.w2.weight), grad)
    return out, gx, *gw


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("shape", [(2, 5, 64), (7, 64)], ids=["rows-seq", "expert-rows"])
def test_the_gate_made_again_in_backward_is_autograds_bit_for_bit(autocast, shape):
    torch.manual_seed(0)
    ff = FeedForward(model_args("tiny"))
    x = torch.randn(shape, requires_grad=True)
    got = _run(ff, x, lambda m, t: m(t), autocast)
    want = _run(ff, x, _reference, autocast)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_two_hidden_sized_tensors_fewer_are_kept():
    """Counted by storage as the activation metric counts (parameters excluded): autograd keeps
    w1 x, w3 x, silu(w1 x) and the gate; plait's keeps w1 x and w3 x."""
    ff = FeedForward(model_args("tiny"))
    x = torch.randn(3, 8, 64, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in ff.parameters()}

    def kept(forward) -> int:
        seen = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward(ff, x)
        return sum(seen.values())

    hidden = 3 * 8 * ff.w1.out_features * 4
    assert kept(_reference) - kept(lambda m, t: m(t)) == 2 * hidden


def test_a_compiled_block_traces_the_plain_composition():
    """Under torch.compile the feed-forward is w2(silu(w1 x) * w3 x), which the compiler may
    fuse and recompute as it chooses (a forward swapped on the module cannot be traced: it
    failed with "'Linear' object has no attribute 'forward'"). Traced by dynamo and run through
    AOTAutograd without a code generator: the same output and gradients as the reference, to
    rounding (the compiled graph may order its operations otherwise)."""
    torch.manual_seed(0)
    ff = FeedForward(model_args("tiny"))
    x = torch.randn(2, 5, 64, requires_grad=True)
    torch._dynamo.reset()
    got = _run(ff, x, lambda m, t: torch.compile(m, backend="aot_eager", fullgraph=True)(t),
               autocast=False)
    want = _run(ff, x, _reference, autocast=False)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
