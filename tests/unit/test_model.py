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
