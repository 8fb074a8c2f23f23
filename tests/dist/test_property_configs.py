"""Property: any configuration either trains (one step, on the world it names) or is refused
before a worker starts with one line naming a field. Never a traceback from inside a run, never a
hang (each world has a time limit)."""

import string

import pytest
from harness import run_world
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from training import run_steps, tiny_config

from plait.cli.commands import check_inputs
from plait.train.checks import validate
from plait.config.schema import ConfigError

FIELDS = {
    "parallel.tp": st.sampled_from([1, 2, 3]),
    "parallel.pp": st.sampled_from([1, 2, 3]),
    "parallel.zero": st.sampled_from([0, 1, 2, 3, 5]),
    "parallel.dp_shard": st.sampled_from([0, 1, 2, 3]),
    "parallel.microbatches": st.sampled_from([0, 1, 2, 3, 4]),
    "parallel.pp_schedule": st.sampled_from(["gpipe", "1f1b", "interleaved", "zb1", "2f2b"]),
    "parallel.sequence_parallel": st.booleans(),
    "parallel.reshard_after_forward": st.booleans(),
    "parallel.compression": st.sampled_from(["none", "fp16", "int8", "topk", "powersgd", "sign",
                                             "zip"]),
    "train.activation_checkpointing": st.sampled_from(["none", "full", "selective", "half"]),
    "train.precision": st.sampled_from(["fp32", "bf16"]),
    "train.global_batch": st.integers(0, 12),
    "train.lr": st.sampled_from([3e-3, float("nan"), -1.0, 1e-2]),
    "model.n_layers": st.integers(1, 4),
    "model.n_heads": st.sampled_from([2, 4, 8]),
    "data.seq_len": st.sampled_from([8, 15, 16, 32]),
}


def _text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"'{value}'"
    if value != value:  # NaN: TOML spells it nan
        return "nan"
    return repr(value)


@st.composite
def configurations(draw):
    chosen = draw(st.sets(st.sampled_from(sorted(FIELDS)), min_size=2, max_size=8))
    overrides = [f"{k}={_text(draw(FIELDS[k]))}" for k in sorted(chosen)]
    return draw(st.sampled_from([1, 2, 4])), overrides


@pytest.mark.timeout(600)
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(configurations())
def test_a_configuration_trains_or_is_refused_in_one_line(case):
    world, overrides = case
    try:
        cfg = tiny_config("train.steps=1", "train.warmup_steps=0", *overrides)
        validate(cfg, world)
        check_inputs(cfg, None)
    except ConfigError as e:
        message = str(e)
        assert "\n" not in message and message.startswith(e.field)
        assert e.field.strip(string.ascii_letters + "_.-") == "" or "=" in e.field
        return
    results = run_world(run_steps, world, cfg, steps=1, timeout=120)
    assert all(len(r["losses"]) == 1 for r in results)
