import pytest
import torch

from plait.model import PRESETS, build_model, count_params, model_args


@pytest.mark.parametrize("preset,billions", [("7b", 6.74), ("70b", 70.55)])
def test_large_presets_build_on_meta_with_published_sizes(preset, billions):
    model = build_model(PRESETS[preset], seed=0, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert count_params(model) / 1e9 == pytest.approx(billions, rel=0.01)


def test_init_is_deterministic_and_independent_of_the_split():
    args = model_args("tiny", n_layers=4)
    a, b = build_model(args, seed=3), build_model(args, seed=3)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    # A model holding only some of the layers (as a pipeline stage would) gets the same weights
    # for them: init depends on the parameter's name, not on what else was built.
    part = build_model(model_args("tiny", n_layers=4), seed=3)
    del part.layers["0"], part.layers["1"]
    full = dict(a.named_parameters())
    for name, p in part.named_parameters():
        assert torch.equal(p, full[name]), name
    other = build_model(args, seed=4)
    assert not torch.equal(other.output.weight, a.output.weight)


def test_forward_shapes_and_causality():
    model = build_model(PRESETS["tiny"], seed=0)
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    out = model(changed)
    torch.testing.assert_close(out[:, :10], logits[:, :10])  # the past does not see the future
    assert not torch.allclose(out[:, 10:], logits[:, 10:])


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "document-mask"])
def test_grouped_query_attention_keeps_keys_and_values_at_their_own_head_count(masked):
    """8 query heads over 2 key/value heads: the output and every gradient equal attention over
    k and v repeated to every query head (fp32; k's and v's gradients summed over each group in
    another order: 1e-5, where values and gradients are of order 1-10), while what autograd keeps
    holds k and v at 2 heads, not 8 (before, the repeated copies: 3 of their 4 heads' bytes
    more, per layer and micro-batch)."""
    from plait.model.llama import causal_attention

    torch.manual_seed(0)
    q = torch.randn(2, 16, 8, 32, requires_grad=True)
    k, v = (torch.randn(2, 16, 2, 32, requires_grad=True) for _ in range(2))
    mask = torch.zeros(2, 1, 16, 16).masked_fill(
        ~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf")) if masked else None
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.shape) or t,
                                                  lambda t: t):
        out = causal_attention(q, k, v, mask)
    assert (2, 2, 16, 32) in kept and (2, 8, 16, 32) in kept  # k, v (b, kv_heads, s, d); q
    assert sum(s == (2, 8, 16, 32) for s in kept) == 2  # q and the output: nothing repeated
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    wide = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = causal_attention(wide[0], wide[1].repeat_interleave(4, 2),
                           wide[2].repeat_interleave(4, 2), mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, torch.autograd.grad(ref.square().sum(), wide), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 1e20], ids=["plain", "overflowing"])
def test_the_norm_keeps_what_a_fused_norm_keeps(dtype, scale):
    """`RootMeanSquareNorm` keeps its input and each row's 1 / rms(x) (fp32), not x / rms(x)
    (fp32, and its bf16 cast where the stream is bf16), which its backward makes again by the
    same operations. Its output and gradients equal autograd's composition of them bit for bit
    (its backward runs autograd's formulas in autograd's order), and where a diverging run's
    mean of squares overflows, its gradients are NaN where the composition's are: what the
    NaN guard stops a run on (tests/e2e/test_cli.py)."""
    from plait.model.llama import RootMeanSquareNorm

    torch.manual_seed(0)
    norm = RootMeanSquareNorm(64, 1e-5).to(dtype)
    norm.weight.data.normal_()
    x = (torch.randn(3, 7, 64) * scale).to(dtype).requires_grad_()
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = norm(x)
    assert sorted((tuple(t.shape), t.dtype) for t in kept) == sorted(
        [((3, 7, 64), dtype), ((64,), dtype), ((3, 7, 1), torch.float32)])
    wide = [t.detach().clone().requires_grad_() for t in (x, norm.weight)]
    xf = wide[0].float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * wide[1]
    assert torch.equal(out, want)
    g = torch.randn_like(out) * scale
    grads = torch.autograd.grad(out, (x, norm.weight), g)
    for got, ref in zip(grads, torch.autograd.grad(want, wide, g), strict=True):
        assert torch.equal(got.isnan(), ref.isnan())
        assert torch.equal(got.nan_to_num(), ref.nan_to_num())
    assert scale == 1.0 or grads[0].isnan().any()
