"""The FLOP count (MFU's numerator) on any torch that pyproject allows, and never a reason for a
run to stop.

torch up to 2.11 counted attention only with as many key/value heads as query heads: on a GPU
(where transformers hands sdpa the grouped heads, `enable_gqa`), a grouped-query model -- the
usual Llama / Qwen / Mistral shape -- stopped at step 0 with "sdpa_flop_count: query/key/value
shapes are incompatible". Here the suite's torch counts those heads itself, so the old counter is
put back in its place to test against."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.distributed as dist
from harness import run_world
from hf_models import hf_config, write_model
from torch.utils import flop_counter

from plait.mesh import build_mesh
from plait.model import build_configured
from plait.predict import trace
from plait.train import trainer as trainer_module
from plait.train.checks import validate
from plait.train.metrics import flops_per_token


def _strict_sdpa_flop_count(query_shape, key_shape, value_shape):
    """torch 2.11's formula: every shape's heads the query's, or an AssertionError."""
    b, h, s_q, d_q = query_shape
    _b2, _h2, s_k, _d2 = key_shape
    _b3, _h3, _s3, d_v = value_shape
    assert b == _b2 == _b3 and h == _h2 == _h3 and d_q == _d2 and s_k == _s3 and d_q == d_v, \
        "sdpa_flop_count: query/key/value shapes are incompatible"
    return flop_counter.bmm_flop((b * h, s_q, d_q), (b * h, d_q, s_k)) + \
        flop_counter.bmm_flop((b * h, s_q, s_k), (b * h, s_k, d_v))


def test_grouped_query_attention_is_counted_with_its_heads_broadcast(tmp_path, monkeypatch):
    cfg = hf_config(write_model(tmp_path / "llama", "llama"))  # 4 query heads, 2 key/value
    counted = trace.model_flops(cfg)
    # As torch 2.11 counted: its formula, which asserts that the heads are equal, sees them so.
    monkeypatch.setattr(flop_counter, "sdpa_flop_count", _strict_sdpa_flop_count)
    original = flop_counter.sdpa_backward_flop_count

    def strict_backward(grad_out_shape, query_shape, key_shape, value_shape):
        assert query_shape[1] == key_shape[1] == value_shape[1] == grad_out_shape[1], \
            "sdpa_backward_flop_count: grad_out/value/key/query shapes are incompatible"
        return original(grad_out_shape, query_shape, key_shape, value_shape)

    monkeypatch.setattr(flop_counter, "sdpa_backward_flop_count", strict_backward)
    trace.MODEL_FLOPS.clear()  # counted again, under the old formulas
    assert trace.model_flops(cfg) == counted
    # ... and the count holds the attention: 4 query heads' scores and weighted sums, forward
    # (2 matmuls) and backward (5), over the global batch, more than the matmuls' 6N.
    args = cfg.model.args()
    attention = 7 * 2 * cfg.train.global_batch * args.n_layers * cfg.data.seq_len ** 2 * args.dim
    meta = build_configured(args, 0, "meta", cfg.model.hf)
    n = sum(p.numel() for p in meta.parameters() if p.dim() == 2) - args.vocab_size * args.dim
    matmuls = 6 * n * cfg.train.global_batch * cfg.data.seq_len  # the embedding is a lookup
    # transformers before 5.2x made the rotary table as a matmul of the inverse frequencies by
    # the positions (one table per forward, no gradient: 2 x head_dim / 2 x seq_len), 5.24
    # elementwise (measured on the GPU machine's transformers 5.17: 256 FLOPs more).
    rotary = 2 * (args.dim // args.n_heads // 2) * cfg.data.seq_len
    assert counted - (matmuls + attention) in (0, rotary)


def _rates_with_a_failing_counter(cfg):
    def fails(_):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    trainer_module.model_flops = fails  # this worker's own copy of the module
    dims = validate(cfg, dist.get_world_size())
    trainer = trainer_module.Trainer(cfg, dims, build_mesh(dims), torch.device("cpu"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        _, flops = trainer._rates()
    return flops, err.getvalue(), trainer.n_params


def test_a_counter_that_fails_falls_back_to_the_formula_with_a_note(tmp_path):
    cfg = hf_config(write_model(tmp_path / "llama", "llama"))
    flops, note, n_params = run_world(_rates_with_a_failing_counter, 1, cfg)[0]
    assert flops == cfg.train.global_batch * cfg.data.seq_len * flops_per_token(
        cfg.model.shape(), n_params, cfg.data.seq_len)
    assert "plait: note: the FLOP count" in note and "AssertionError" in note, note


@pytest.mark.parametrize("overrides,ranks", [
    (["parallel.microbatches=4"], 2),
    (["parallel.microbatches=2", "parallel.zero=3", "train.precision=bf16",
      "data.document_mask=true"], 2),
    (["parallel.microbatches=2", "parallel.tp=2", "parallel.sequence_parallel=true",
      "train.activation_checkpointing=selective"], 4),
], ids=["dp2-accum4", "zero3-bf16-documents-accum2", "tp2-sp-selective-accum2"])
def test_without_a_pipeline_the_first_micro_batch_stands_for_the_step(overrides, ranks):
    """The planner and the dry run (`trace.trace_class`) trace a step's first micro-batch
    alone where there is no pipeline: its peak activations are the step's (its inputs views of
    the whole batch's windows, as every micro-batch's are) and its FLOPs, times the number of
    micro-batches, the step's, exactly as tracing every one (each row's dry run is also compared
    with its measured run in tests/dist)."""
    from training import tiny_config

    cfg = tiny_config(*overrides)
    dims = validate(cfg, ranks)
    every, first = (trace.trace_rank(cfg, dims, 0, first_only=f) for f in (False, True))
    assert (first.activation_bytes, first.flops) == (every.activation_bytes, every.flops)
    assert trace.first_stands_for_all(cfg, dims)
    assert first.recomputed_flops == every.recomputed_flops


@pytest.mark.parametrize("overrides,ranks", [
    (["parallel.pp=2", "parallel.microbatches=8"], 2),
    (["parallel.pp=2", "parallel.microbatches=8", "parallel.pp_schedule=interleaved",
      "model.n_layers=4", "train.activation_checkpointing=full"], 2),
    (["parallel.pp=2", "parallel.microbatches=6", "parallel.pp_schedule=zb1",
      "train.global_batch=12", "parallel.tp=2", "parallel.sequence_parallel=true"], 4),
    (["parallel.pp=3", "parallel.microbatches=6", "model.n_layers=3", "train.precision=bf16",
      "train.global_batch=12"], 3),
], ids=["pp2-1f1b-m8", "pp2-interleaved-m8-full", "pp2-zb1-m6-tp2-sp", "pp3-1f1b-m6-bf16"])
def test_a_pipeline_stage_is_traced_with_the_micro_batches_it_holds_at_its_fullest(overrides,
                                                                                   ranks):
    """With a pipeline, the planner and the dry run trace each stage with the fewest
    micro-batches whose schedule holds, at its fullest, what the step's does
    (`pipeline.fewest_microbatches`): fewer than the step's here on every stage, and the same
    peak activations, FLOPs and recomputed FLOPs as tracing them all, exactly."""
    from training import tiny_config

    from plait.parallel.pipeline import fewest_microbatches

    cfg = tiny_config(*overrides)
    dims = validate(cfg, ranks)
    for stage in range(dims.pp):
        rank = dims.rank(pp=stage)
        assert fewest_microbatches(cfg.parallel, dims.pp, cfg.parallel.microbatches, stage) < \
            cfg.parallel.microbatches
        every, fewer = (trace.trace_rank(cfg, dims, rank, first_only=f) for f in (False, True))
        assert (fewer.activation_bytes, fewer.flops, fewer.recomputed_flops) == \
            (every.activation_bytes, every.flops, every.recomputed_flops), stage


@pytest.mark.parametrize("overrides,ranks", [
    (["train.activation_checkpointing=full"], 1),
    (["train.activation_checkpointing=selective", "parallel.tp=2"], 2),
    (["train.activation_checkpointing=full", "parallel.pp=2", "parallel.microbatches=2",
      "parallel.pp_schedule=1f1b"], 2),
], ids=["full", "tp2-selective", "pp2-1f1b-full"])
def test_recomputation_is_counted_apart(overrides, ranks):
    """A trace counts the FLOPs that activation checkpointing's recomputation runs apart
    (`RankTrace.recomputed_flops`): the step's FLOPs less those are the same step's without
    recomputation, exactly (the planner's model FLOPs, MFU's numerator, from one trace where it
    took two), on every pipeline stage."""
    from training import tiny_config

    cfg = tiny_config(*overrides)
    dims = validate(cfg, ranks)
    plain_cfg = tiny_config(*overrides, "train.activation_checkpointing=none")
    for stage in range(dims.pp):
        rank = dims.rank(pp=stage)
        kept, plain = (trace.trace_rank(c, dims, rank) for c in (cfg, plain_cfg))
        assert kept.recomputed_flops > 0 and plain.recomputed_flops == 0
        assert kept.flops - kept.recomputed_flops == plain.flops, stage


def test_a_trace_stands_for_every_zero_stage_offload_and_device():
    """`trace_class` keys its cache without ZeRO's stage, offload and the run's device: each
    keeps the same tensors for backward and runs the same FLOPs, as traced here (tp2, so that
    the stages' buckets and slices differ)."""
    from training import tiny_config

    base = ["parallel.tp=2", "parallel.microbatches=2"]
    dims, traced = validate(tiny_config(*base), 4), {}  # (as the planner prices a GPU's)
    for extra in ([], ["parallel.zero=2", "parallel.offload=optimizer"],
                  ["parallel.zero=3", "parallel.offload=params", "train.device=cuda"]):
        t = trace.trace_rank(tiny_config(*base, *extra), dims, 0)
        traced[" ".join(extra)] = (t.activation_bytes, t.flops)
    assert len(set(traced.values())) == 1, traced


@pytest.mark.parametrize("family", ["plait", "mixtral"])
def test_counting_without_decomposition_tries_counts_as_torchs_counter(tmp_path, monkeypatch,
                                                                      family):
    """`trace._Counting` runs an operation that has no decomposition at once instead of first
    trying to decompose it (torch's counter tries every one): a step's FLOPs, recomputed FLOPs
    and activations equal what torch's own dispatch counts, on a pipeline stage of plait's Llama
    with tp2 + sp and recomputation, and on transformers' Mixtral (attention's kernel, grouped
    matmuls, an experts loop) at dp2."""
    from training import tiny_config

    if family == "plait":
        cfg = tiny_config("parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                          "parallel.microbatches=2", "train.activation_checkpointing=selective")
    else:
        cfg = hf_config(write_model(tmp_path / family, family))
    dims = validate(cfg, 4 if family == "plait" else 2)
    fast = trace.trace_rank(cfg, dims, dims.world_size - 1)
    monkeypatch.setattr(trace._Counting, "__torch_dispatch__",
                        flop_counter._FlopCounterMode.__torch_dispatch__)
    torchs = trace.trace_rank(cfg, dims, dims.world_size - 1)
    assert fast.flops > 0
    assert (fast.flops, fast.recomputed_flops, fast.activation_bytes) == \
        (torchs.flops, torchs.recomputed_flops, torchs.activation_bytes)
