"""fp16's loss scale (`plait/optim/loss_scaling.py`) against torch's own rule: with hysteresis 1
`LossScaler` is `torch.amp.GradScaler`, for any sequence of clean and overflowing steps; with
hysteresis H it tolerates H - 1 overflows after each growth (Megatron's DynamicGradScaler); a scale
falling below its minimum stops the run naming the key; a static scale never moves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.optim.loss_scaling import LossScaler, LossScaleTooSmall


def torch_scales(overflows: list[bool], init: float, interval: int) -> list[float]:
    """GradScaler's scale after each step, an overflow made by an infinite gradient."""
    p = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval)
    out = []
    for overflow in overflows:
        optimizer.zero_grad()
        scaler.scale(p.sum()).backward()
        if overflow:
            p.grad.fill_(float("inf"))
        scaler.step(optimizer)
        scaler.update()
        out.append(scaler.get_scale())
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.booleans(), max_size=40), st.integers(0, 30), st.integers(1, 5))
def test_hysteresis_one_is_grad_scaler(overflows, power, interval):
    ours = LossScaler(scale=2.0**power, growth_interval=interval, min_scale=2.0**-60)
    got = []
    for overflow in overflows:
        ours.update(overflow)
        got.append(ours.scale)
    assert got == torch_scales(overflows, 2.0**power, interval)
    assert ours.skipped == sum(overflows)


def test_hysteresis_tolerates_overflows_until_a_growth_restores_it():
    s = LossScaler(scale=2.0**10, growth_interval=2, hysteresis=2)
    trace = []
    for overflow in (True, True, True, False, False, True, False):
        s.update(overflow)
        trace.append(s.scale)
    # 1st overflow tolerated, 2nd and 3rd halve; 2 clean steps double and restore the allowance
    # of 2, so the next overflow is tolerated again.
    assert trace == [2.0**10, 2.0**9, 2.0**8, 2.0**8, 2.0**9, 2.0**9, 2.0**9]
    assert s.skipped == 4


def test_a_scale_below_its_minimum_stops_naming_the_key():
    s = LossScaler(scale=4.0, min_scale=2.0)
    s.update(True)
    assert s.scale == 2.0
    with pytest.raises(LossScaleTooSmall, match="^train.loss_scale_min: "):
        s.update(True)


def test_a_static_scale_never_moves_but_overflows_are_skipped():
    s = LossScaler(scale=1000.0, dynamic=False, growth_interval=1)
    for overflow in (False, True, False, False):
        s.update(overflow)
    assert (s.scale, s.skipped) == (1000.0, 1)


def test_the_state_round_trips():
    s = LossScaler(scale=2.0**12, growth_interval=3, hysteresis=2)
    for overflow in (False, True, False):
        s.update(overflow)
    t = LossScaler(scale=1.0, growth_interval=3, hysteresis=2)
    t.load_state_tensors(s.state_tensors())
    assert (t.scale, t.growth_tracker, t.hysteresis_left, t.skipped) == \
        (s.scale, s.growth_tracker, s.hysteresis_left, s.skipped) == (2.0**12, 1, 1, 1)
