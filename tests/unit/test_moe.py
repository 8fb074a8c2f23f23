"""The mixture-of-experts layer on one device: routing, capacity, the auxiliary losses and the
statistics, on hand-made router outputs whose answers are worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from plait.model import build_model, model_args
from plait.model.moe import (
    RANK_STEP,
    MoEFeedForward,
    aux_loss,
    capacity,
    expert_choice,
    token_choice,
    z_loss,
)

# Four tokens, two experts.
PROBS = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])


def pairs(routing):
    return sorted(zip(routing.token.tolist(), routing.expert.tolist(), strict=True))


def test_aux_loss_of_a_known_routing():
    # Top-1 picks expert 0 for tokens 0, 1, 3: f = (3/4, 1/4); P = (0.65, 0.35);
    # aux = 2 * (0.75 * 0.65 + 0.25 * 0.35) = 1.15.
    r = token_choice(PROBS, 1, None)
    assert r.picked.tolist() == [3, 1]
    assert aux_loss(r.picked, PROBS.mean(0)).item() == pytest.approx(1.15)
    # Balanced: 1 whatever E; all on one expert with certainty: E.
    assert aux_loss(torch.tensor([2, 2, 2, 2]), torch.full((4,), 0.25)).item() == \
        pytest.approx(1.0)
    assert aux_loss(torch.tensor([5, 0, 0]), torch.tensor([1.0, 0, 0])).item() == \
        pytest.approx(3.0)


def test_capacity_drops_past_the_limit_in_token_order():
    # capacity = ceil(1.0 * 4 tokens * 1 / 2 experts) = 2: expert 0 wanted by tokens 0, 1, 3
    # keeps 0 and 1; token 3 is dropped (no other choice at k = 1).
    cap = capacity(4, 1, 2, 1.0)
    assert cap == 2
    r = token_choice(PROBS, 1, cap)
    assert pairs(r) == [(0, 0), (1, 0), (2, 1)]
    assert r.kept.tolist() == [2, 1] and r.picked.tolist() == [3, 1] and r.dropped == 1
    assert capacity(4, 1, 2, 0.0) is None  # dropless


def test_top2_serves_first_choices_before_second_choices():
    probs = torch.tensor([[0.5, 0.3, 0.2],   # first e0, second e1
                          [0.1, 0.6, 0.3],   # first e1, second e2
                          [0.2, 0.7, 0.1]])  # first e1, second e0
    cap = capacity(3, 2, 3, 0.5)  # ceil(0.5 * 3 * 2 / 3) = 1
    r = token_choice(probs, 2, cap)
    # First choices in token order: t0->e0 kept, t1->e1 kept, t2->e1 full. Second choices:
    # t0->e1 full, t1->e2 kept, t2->e0 full. Token 2 has no expert left: dropped.
    assert pairs(r) == [(0, 0), (1, 1), (1, 2)]
    assert r.picked.tolist() == [2, 3, 1] and r.kept.tolist() == [1, 1, 1] and r.dropped == 1
    weights = dict(zip(zip(r.token.tolist(), r.expert.tolist(), strict=True), r.weight.tolist(),
                       strict=True))
    # Gates renormalised over each token's top 2, before any drop.
    assert weights[(0, 0)] == pytest.approx(0.5 / 0.8)
    assert weights[(1, 1)] == pytest.approx(0.6 / 0.9)
    assert weights[(1, 2)] == pytest.approx(0.3 / 0.9)


def test_ties_go_to_the_lower_index():
    r = token_choice(torch.full((2, 4), 0.25), 2, None)
    assert pairs(r) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    e = expert_choice(torch.full((3, 2), 0.5), 2)
    assert pairs(e) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # each expert takes tokens 0 and 1
    assert e.dropped == 1  # token 2


def test_a_tie_off_by_the_last_bit_is_still_a_tie():
    """Identical contexts whose scores a kernel rounded one ulp apart: the later token's higher
    by 2^-26 (the ulp of values in [1/8, 1/4)). Ranked raw, the later token would win; at
    RANK_STEP = 2^-16 they tie and the earlier token wins, in either order of the noise."""
    base = torch.tensor([[0.1378246099, 0.8621753901]] * 3)
    for noisy in (1, 2):  # the bump on token 1, then on token 2
        probs = base.clone()
        probs[noisy, 0] = torch.nextafter(probs[noisy, 0], torch.tensor(1.0))
        assert probs[noisy, 0] > probs[0, 0]
        assert pairs(expert_choice(probs, 1)) == [(0, 0), (0, 1)]
    # A gap of one RANK_STEP or more is not a tie.
    probs = base.clone()
    probs[2, 0] += RANK_STEP
    assert pairs(expert_choice(probs, 1)) == [(0, 1), (2, 0)]
    # Separate ranking scores: the choice follows them, the gates stay the probabilities'.
    scores = torch.tensor([[0.1, 0.9], [0.7, 0.3], [0.2, 0.8]])
    r = expert_choice(base, 1, scores)
    assert pairs(r) == [(0, 1), (1, 0)]
    assert r.weight.tolist() == [base[1, 0].item(), base[0, 1].item()]


def test_expert_choice_takes_each_experts_top_tokens():
    r = expert_choice(PROBS, 2)
    assert pairs(r) == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert r.kept.tolist() == [2, 2] and r.dropped == 0
    assert r.weight.tolist() == pytest.approx([0.9, 0.8, 0.7, 0.4])


def test_z_loss():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    # logsumexp: log 2 and log 4.
    assert z_loss(logits).item() == pytest.approx((math.log(2) ** 2 + math.log(4) ** 2) / 2)


def layer(**overrides) -> MoEFeedForward:
    args = model_args("tiny-moe", **overrides)
    return build_model(args, 0).layers["0"].feed_forward


def test_dropped_tokens_pass_through_and_idle_experts_get_zero_gradients():
    moe = layer(moe_experts=4, moe_top_k=1, moe_capacity_factor=0.25, moe_aux_loss_coef=0.0)
    with torch.no_grad():  # every token prefers expert 0: capacity ceil(0.25 * 8 / 4) = 1
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0
    x = torch.ones(1, 8, moe.router.in_features)
    out = moe(x)
    assert out[0, 1:].abs().sum() == 0 and out[0, 0].abs().sum() > 0  # 7 dropped: output 0
    out.sum().backward()
    for e in ("1", "2", "3"):  # no tokens: gradient zero, not missing
        assert moe.experts[e].w1.weight.grad is not None
        assert moe.experts[e].w1.weight.grad.abs().sum() == 0
    stats = moe.stats[-1]
    assert stats.dropped == pytest.approx(7 / 8)
    assert stats.kept.tolist() == [1, 0, 0, 0]
    assert stats.aux_loss == pytest.approx(4 * 1.0 * moe.router(x[0]).softmax(-1)[:, 0].mean()
                                           .item())


def test_route_groups_apply_capacity_per_group():
    moe = layer(moe_capacity_factor=1.0)
    probs = torch.rand(16, 8, generator=torch.Generator().manual_seed(0)).softmax(-1)
    moe.route_groups = 2
    both = moe.route(probs)
    cap = capacity(8, 2, 8, 1.0)
    halves = [token_choice(p, 2, cap) for p in probs.chunk(2)]
    want = sorted([(t, e) for t, e in pairs(halves[0])] + [(t + 8, e) for t, e in
                                                            pairs(halves[1])])
    assert pairs(both) == want
    assert both.dropped == sum(h.dropped for h in halves)


def test_aux_loss_gradient_reaches_the_router():
    """The attached loss trains the router as if added to the objective."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    moe = layer(moe_aux_loss_coef=0.5, moe_z_loss_coef=0.1)
    moe(x).sum().backward()
    attached = moe.router.weight.grad.clone()
    moe.zero_grad()
    plain = layer(moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0)
    out = plain(x)
    tokens = x.reshape(-1, 64)
    logits = tokens @ plain.router.weight.t()
    probs = logits.softmax(-1)
    routing = plain.route(probs)
    explicit = out.sum() + 0.5 * aux_loss(routing.picked, probs.mean(0)) + 0.1 * z_loss(logits)
    explicit.backward()
    torch.testing.assert_close(attached, plain.router.weight.grad, rtol=1e-5, atol=1e-7)


def test_fake_tokens_are_routed_evenly_with_the_real_routings_shapes():
    """A trace (plait.predict.trace) routes fake tokens, which hold no values, as a plan prices
    them: each expert an even share of the N k picks, at most the capacity; the routing's
    tensors have the shapes a real routing of that share has, and backward reaches the router."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = torch.empty(10, 3, requires_grad=True)
        probs = logits.softmax(-1)
        r = token_choice(probs, 2, capacity(10, 2, 3, 1.0))  # 20 picks: 7, 7, 6; cap 7
        assert r.counts == [7, 7, 6] and r.picked.shape == (3,)
        assert r.token.shape == r.expert.shape == r.weight.shape == (20,)
        capped = token_choice(probs, 2, 5)
        assert capped.counts == [5, 5, 5] and capped.weight.shape == (15,)
        capped.weight.sum().backward()
        assert logits.grad.shape == (10, 3)
        assert expert_choice(probs, 4).counts == [4, 4, 4]
    real = token_choice(PROBS, 1, None)
    assert real.counts is None and real.kept_counts() == [3, 1]
