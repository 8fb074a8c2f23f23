"""The planner's GPU time model (`planner.gemm`) against measurements: the matrix products of an
H200 (`plait bench gemm`, tests/data/gemm_h200.json), to which it was fitted, and of an H100
(tests/data/gemm_h100.json), which it predicts, and published runs on A100 and H100
clusters (`bench.published`), each layout pinned as published. No timing is taken here: the
measurements are data."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import pytest

from plait.config.schema import ConfigError, load_config
from plait.planner.gemm import gemm_seconds
from plait.planner.hardware import (
    COMPILE_S,
    DEVICES,
    PLAIT_2026_11_26,
    Cluster,
    planned_precision,
)

DATA = Path(__file__).parent.parent / "data"
SWEEP = json.loads((DATA / "gemm_h200.json").read_text())


def _log_errors(sweep: dict, device: str, dtype: str) -> dict:
    """|log(predicted / measured)| of each product of `dtype` in a `plait bench gemm` sweep."""
    return {(r["m"], r["n"], r["k"]): abs(math.log(gemm_seconds(
        r["m"], r["n"], r["k"], DEVICES[device], dtype == "fp8") / r["seconds"]))
        for r in sweep["rows"] if r["dtype"] == dtype}


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_the_shape_model_follows_the_measured_products(dtype):
    """Median |log error| within 10% over the 147 shapes of each dtype (the constants were fitted
    to them: this holds the fit, not a prediction), the large products (m, n, k >= 4096) within
    20%, and the model sees what the device does: a thin product far below a large one."""
    h200 = DEVICES["h200"]
    errors = _log_errors(SWEEP, "h200", dtype)
    assert len(errors) == 147 and statistics.median(errors.values()) < 0.10
    assert max(e for (m, n, k), e in errors.items() if min(m, n, k) >= 4096) < 0.20

    def rate(m, n, k):
        return 2 * m * n * k / gemm_seconds(m, n, k, h200, dtype == "fp8")

    assert rate(1024, 512, 512) < 0.1 * rate(16384, 8192, 8192)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_the_shape_model_predicts_another_devices_products(dtype):
    """An H100 SXM (the H200's chip with less and slower memory; torch 2.11, measured
    2026-11-26), priced from its datasheet peak with the H200's constants: median |log error|
    9.7% (bf16) and 11.3% (fp8), large products at most 9.9% and 15.5%; held to 15% and 20%."""
    errors = _log_errors(json.loads((DATA / "gemm_h100.json").read_text()), "h100", dtype)
    assert len(errors) == 147 and statistics.median(errors.values()) < 0.15
    assert max(e for (m, n, k), e in errors.items() if min(m, n, k) >= 4096) < 0.20


# plait's own step on one GPU (`plait train --nproc 1 train.device=cuda train.precision=bf16
# data.seq_len=2048`, median step, torch 2.11; docs/benchmarks.md), eager, as it ran on
# 2026-11-26 (`hardware.PLAIT_2026_11_26`: AdamW foreach): the H200's 1B step calibrated the
# elementwise passes (`hardware.Engine`); the H100 is a device no constant came from.
OWN_STEPS = [
    ("h200", "1b", 8, "none", 0.426), ("h200", "125m", 16, "none", 0.153),
    ("h200", "1b", 8, "full", 0.510),
    ("h100", "1b", 8, "none", 0.484), ("h100", "125m", 16, "none", 0.181),
    ("h100", "1b", 8, "full", 0.577),
]


@pytest.mark.parametrize("gpu,preset,batch,recompute,measured", OWN_STEPS)
def test_plaits_own_step_on_one_gpu(gpu, preset, batch, recompute, measured):
    """Within 10%, and 20% under full recomputation, which is over-priced (+7% on the H200, +15%
    on the H100: elementwise passes priced at the memory's rate, 1.42 times slower on the H100,
    took 1.26 times as long there)."""
    from plait.planner.price import estimate
    from plait.train.checks import validate

    cfg = load_config(None, [f"model.preset='{preset}'", f"train.global_batch={batch}",
                             "data.seq_len=2048", "train.precision='bf16'",
                             f"train.activation_checkpointing='{recompute}'",
                             "train.compile=false"])
    cluster = Cluster(1, 8, DEVICES[gpu], PLAIT_2026_11_26)
    predicted = estimate(cfg, validate(cfg, 1), cluster).step_time_s
    assert abs(predicted / measured - 1) <= (0.20 if recompute == "full" else 0.10), predicted


@pytest.mark.parametrize("compiled,measured", [(False, 0.4327), (True, 0.2819)])
def test_plaits_step_as_it_runs_now_on_an_h100(compiled, measured):
    """`plait bench gpu` on an H100 (2026-11-27, one run, the third session's): plait's 1B step
    eager and with compiled blocks and fused loss, fused AdamW (`hardware.PLAIT`, the default
    engine). The compiled passes
    were fitted to the ratio of these two steps, so the two errors are alike; both within 12%:
    the H100's elementwise work is priced at its memory's rate, 1.42 times the H200's time,
    where its kernels took 1.26 times as long (+7% on this step, as the rows above), and the
    fitted passes still hold the gradient norm's fp64 copies that plait no longer makes (~30 GB
    a step, 3%)."""
    from plait.planner.price import estimate
    from plait.train.checks import validate

    cfg = load_config(None, ["model.preset='1b'", "train.global_batch=8", "data.seq_len=2048",
                             "train.precision='bf16'", f"train.compile={str(compiled).lower()}"])
    priced = estimate(cfg, validate(cfg, 1), Cluster(1, 8, DEVICES["h100"]))
    assert abs(priced.step_time_s / measured - 1) <= 0.12, priced.step_time_s
    assert priced.compile_s == (COMPILE_S if compiled else 0.0)


def test_fp8_is_priced_on_devices_that_have_it_and_refused_by_the_engine():
    cfg = load_config(None, ["model.preset='1b'", "train.precision='fp8'"])
    priced, cluster = planned_precision(cfg, Cluster(8, 8, DEVICES["h100"]))
    assert priced.train.precision == "bf16" and cluster.engine.fp8
    with pytest.raises(ConfigError, match="no fp8 tensor cores"):
        planned_precision(cfg, Cluster(8, 8, DEVICES["a100"]))
    from plait.train.checks import validate

    with pytest.raises(ConfigError, match="priced by plait plan only"):
        validate(cfg, 1)
    assert gemm_seconds(4096, 4096, 4096, DEVICES["h100"], fp8=True) < \
        0.75 * gemm_seconds(4096, 4096, 4096, DEVICES["h100"])


@pytest.fixture(scope="module")
def published():
    from plait.bench.published import published_rows

    return published_rows(rank=False)


def test_megatrons_weak_scaling_table_within_ten_percent_with_its_slope(published):
    """Megatron-LM's Table 1 (1.7B to 1T on A100s): median |error| of the throughput within 10%,
    the worst within 20%, and the predicted teraFLOP/s per GPU rises with the model as the
    published ones do (137 to 163: larger matmuls, a smaller share of elementwise work)."""
    rows = [r for r in published if r["source"].startswith("Narayanan")]
    errors = [abs(r["predicted"] / r["published"] - 1) for r in rows]
    assert len(rows) == 10 and statistics.median(errors) <= 0.10 and max(errors) <= 0.20, errors
    x = [math.log(r["params"]) for r in rows]
    y = [r["predicted"] / r["published"] for r in rows]  # x the published rate
    published_rate = [137, 138, 142, 135, 138, 140, 148, 155, 163, 163]
    predicted = [a * b for a, b in zip(y, published_rate, strict=True)]
    mean_x, mean_y = statistics.mean(x), statistics.mean(predicted)
    slope = sum((a - mean_x) * (b - mean_y) for a, b in zip(x, predicted, strict=True))
    assert slope > 0


def test_torchtitans_runs_fit_where_they_ran_and_price_within_a_quarter(published):
    """torchtitan's rows (H100 96 GB 500 W; two on A100): every one fits without offload where
    it ran (the 8B at tp 8 did not while plait's column-parallel linears kept their gathered
    inputs under sequence parallelism: 84.6 GiB with params offload;
    `parallel/sequence_parallel.py`), each within 25% (median 10%; eager and compiled alike
    priced as plait's eager step, attention on the H100s at FlashAttention-2's rate, which the
    torch of those runs used), and the 8B at FSDP on 8 GPUs, which held 82.4 GiB there, below
    that (it needed offload while plait's SwiGLU kept its gate: 90.2 GiB)."""
    rows = [r for r in published if r["source"].startswith("torchtitan")]
    plain = [r for r in rows if r["fits"] and r["degrees"]["offload"] == "none"]
    errors = [abs(r["predicted"] / r["published"] - 1) for r in plain]
    assert plain == rows and statistics.median(errors) <= 0.10 and max(errors) <= 0.25, errors
    eight = next(r for r in rows if r["name"] == "8B FSDP" and r["gpus"] == 8)
    assert eight in plain and eight["memory_gib"] < eight["published_gib"]


def test_the_issues_criterion_over_megatron_and_torchtitan(published):
    """Over Megatron-LM's Table 1 and torchtitan's rows together, each layout pinned: median
    |error| on throughput within 10%, the worst within 25% (Llama 3's rows, Meta's own engine,
    are shown beside, not counted)."""
    rows = [r for r in published if r["source"].startswith(("Narayanan", "torchtitan"))]
    errors = [abs(r["predicted"] / r["published"] - 1) for r in rows]
    assert len(rows) == 26 and statistics.median(errors) <= 0.10 and max(errors) <= 0.25, errors


def test_plait_plan_reproduces_every_published_row_from_the_command_line(published, capsys):
    """`plait plan --engine E --gpu G --gpus N <model> <pins>` (`published.plan_command`) prices
    each published run as `bench plan --which published` does: the same throughput, to the
    last digit (it could not select an engine, so every row was priced as plait's step)."""
    import json

    from plait import cli
    from plait.bench.published import PUBLISHED, plan_command

    assert len(published) == len(PUBLISHED)
    engines = set()
    for row, want in zip(PUBLISHED, published, strict=True):
        cli.main([*plan_command(row), "--json", "--top", "1"])
        got = json.loads(capsys.readouterr().out)[0]
        assert got["tokens_per_s"] == pytest.approx(want["predicted"], rel=1e-12), row.name
        engines.add(plan_command(row)[plan_command(row).index("--engine") + 1])
    assert engines == {"megatron-2021", "megatron", "torchtitan"}


def test_each_published_row_is_priced_as_its_run_ran():
    """Megatron-LM's Table 1 ran in 2021, before sequence parallelism (Korthikanti et al. 2022),
    on half parameters: its rows pin sequence parallelism off, and its engine's search never
    offers it; an engine without autocast is priced on plait's half parameters (its residual,
    tp reductions and pipeline sends half too), which plait's own engine is not unless the run
    says so. torchtitan's tp rows shard the norms, as its plan does."""
    from plait.bench.published import MEGATRON, PUBLISHED, _cluster, engine_of
    from plait.planner.hardware import ENGINES, planned_precision
    from plait.planner.search import candidates

    for row in PUBLISHED:
        sp = row.pins.get("sequence_parallel", row.pins["tp"] > 1)
        assert sp == (row.source != MEGATRON and row.pins["tp"] > 1), row.name
        assert ENGINES[engine_of(row)].sequence_parallel == (row.source != MEGATRON), row.name
    table = next(r for r in PUBLISHED if r.source == MEGATRON and r.pins["tp"] == 8)
    cfg = load_config(None, [*table.model, f"train.global_batch={table.batch}",
                             "train.precision='bf16'"])
    priced, cluster = planned_precision(cfg, _cluster(table))
    assert priced.train.param_dtype == "bf16"
    layouts = [c for c, _ in candidates(priced, cluster, {"pp": 1, "tp": 8})]
    assert layouts and not any(c.parallel.sequence_parallel for c in layouts)
    own, _ = planned_precision(cfg, dataclasses.replace(cluster, engine=ENGINES["plait"]))
    assert own.train.param_dtype == "auto"
    assert any(c.parallel.sequence_parallel for c, _ in candidates(
        own, dataclasses.replace(cluster, engine=ENGINES["plait"]), {"pp": 1, "tp": 8}))


def test_sequence_parallel_gathers_cost_only_autocasts_cast():
    """Sequence parallelism's gathered inputs go from the all-gather to the matmuls: no
    elementwise traffic with bf16 parameters (ZeRO) or in fp32; under autocast over fp32
    parameters, an fp32 -> bf16 cast (6 bytes an element) per linear in forward (q, k, v; w1,
    w3) and per half in backward (`ShardKeepingLinear`)."""
    from plait.config.schema import load_config
    from plait.mesh import ParallelDims
    from plait.predict.activations import regathered_bytes

    dims, rows = ParallelDims(tp=4, dp=2), 2
    base = ["model.preset='small'", "data.seq_len=256", "parallel.sequence_parallel=true"]
    for extra, want in ((["train.precision='bf16'"], 2 * 7 * rows * 256 * 192 * 6),
                        (["train.precision='bf16'", "parallel.zero=3"], 0), ([], 0)):
        cfg = load_config(None, [*base, *extra])
        assert regathered_bytes(cfg, dims, rows, 2) == want
        assert regathered_bytes(cfg, ParallelDims(tp=1, dp=8), rows, 2) == 0
    cfg = load_config(None, [*base, "train.precision='bf16'"])
    assert regathered_bytes(cfg, dims, rows, 2, moe=1) == (7 + 4) * rows * 256 * 192 * 6


def test_deepspeeds_zero3_is_priced_with_its_own_units_and_bound():
    """DeepSpeed's ZeRO-3 gathers each module's own parameters, at most
    `stage3_max_live_parameters` (1e9) at once: the `deepspeed` engine prices a ZeRO-3 layout
    as plait's engine cut so (`parallel.wrap = "1"`, `parallel.max_live_params`: the formulas the
    composition matrix holds plait's engine to), which holds less than the same engine gathering
    whole blocks (two 70B blocks and their gradients' staging); a run that names its own units
    or bound keeps them, and ZeRO-1/2 have none."""
    from plait.planner.hardware import ENGINES, Cluster, device
    from plait.planner.price import engine_zero3
    from plait.planner.search import rank_plans

    base = ["model.preset='70b'", "data.seq_len=4096", "train.global_batch=64",
            "train.precision='bf16'"]
    cfg = load_config(None, [*base, "parallel.zero=3"])
    deepspeed = ENGINES["deepspeed"]
    priced = engine_zero3(cfg, deepspeed).parallel
    assert (priced.wrap, priced.max_live_params) == ("1", 10**9)
    own = load_config(None, [*base, "parallel.zero=3", "parallel.wrap='Block'"])
    assert engine_zero3(own, deepspeed) == own
    one = load_config(None, [*base, "parallel.zero=1"])
    assert engine_zero3(one, deepspeed) == one
    pins = {"tp": 1, "pp": 1, "cp": 1, "zero": 3, "microbatches": 1, "offload": "none",
            "activation_checkpointing": "full"}
    peaks = [rank_plans(cfg, Cluster(64, 8, device("a100"), engine), pins)[0].memory_bytes["peak"]
             for engine in (deepspeed, dataclasses.replace(deepspeed, zero3_wrap="",
                                                           max_live_params=0))]
    assert peaks[0] < peaks[1] - 4 * 2**30, peaks
