"""`train.compile`: every block's forward through torch.compile trains what eager training
trains, under each layout, against the same single-process eager run the matrix compares with.

The layout rows use the "aot_eager" backend: the whole of torch.compile's front end (dynamo's
capture of each block with the transforms' hooks around it, graph breaks at tensor parallelism's
and the ring's collectives, AOTAutograd's joint forward and backward), without generating code,
which costs 5-50 s per graph and process on this CPU. One row runs inductor itself, fused CPU
kernels and all, at one rank.

Tolerances: the fp32 matrix's (losses relative 1e-5; parameters after 4 AdamW steps
`training.assert_params_close`): a compiled graph computes what the eager ops compute, in an
order of its own within a fused kernel (inductor's reductions: RMSNorm's mean of squares,
softmax), which moves results by float32's rounding, ~1e-7 relative per operation, the same
amount as another layout's summation order; a block left out of the backward, or run twice,
moves the loss by ~1e-2.
"""

from __future__ import annotations

import os

import pytest
import torch
from harness import run_world
from hf_models import hf_config, train_reference, write_model
from matrix import held
from torch._dynamo.utils import counters
from training import assert_params_close, run_steps, tiny_config

from plait.parallel.compile import compiled_graphs, graph_breaks

BASE = ["model.n_layers=4", "train.warmup_steps=2", "train.steps=4"]
AOT = ["train.compile=true", "train.compile_backend='aot_eager'"]

ROWS = [
    ("ddp-dp2", 2, []),
    ("zero3-dp2-ac-full", 2, ["parallel.zero=3", "train.activation_checkpointing=full"]),
    ("tp2-sp", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("pp2-1f1b", 2, ["parallel.pp=2", "parallel.pp_schedule='1f1b'", "parallel.microbatches=2"]),
    ("cp2-ring", 2, ["parallel.cp=2"]),
]


def config(*overrides):
    return tiny_config(*BASE, *overrides)


def as_a_new_process() -> None:
    """Dynamo's caches and counters as a new process has them: a rank is forked from the pytest
    process, which may have compiled or counted before (an earlier test, in its own process)."""
    torch._dynamo.reset()
    counters.clear()


def with_compile_counts(cfg):
    as_a_new_process()
    out = run_steps(cfg)
    out["graphs"], (out["breaks"], _) = compiled_graphs(), graph_breaks()
    return out


@pytest.fixture(scope="module")
def reference():
    return run_world(run_steps, 1, config())[0]


def _equal(results, ref):
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=0)
        for name, p in r["params"].items():
            assert_params_close(p, held(ref["params"][name], r["placements"][name]), name,
                                steps=4)


@pytest.mark.parametrize("ranks,overrides", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_compiled_blocks_train_what_eager_training_trains(reference, ranks, overrides):
    cfg = config(*AOT, *overrides)
    results = run_world(with_compile_counts, ranks, cfg, timeout=240)
    _equal(results, reference)
    for r in results:
        assert r["graphs"] > 0  # something was compiled, and not once per layer: every block
        # is one graph (or, split at a graph break, the same few pieces) for all 4 layers,
        # forward with its backward; evaluation's no-grad forward is another
        assert r["graphs"] <= 2 * (1 + r["breaks"]), (r["graphs"], r["breaks"])


# Compiled against eager under the same layout, in the same processes (aot_eager runs the ops
# eager runs, in the same dtypes: the fp32 rows' tolerances hold for half precision too): a
# mixture of experts' routing (the router and the all-to-all stay eager at the block's edge,
# `torch.compiler.disable`) with document masks; fp16's loss scaling with Ulysses and selective
# recomputation (the recomputed modules run eager between the block's compiled pieces: traced
# into its graph, torch.utils.checkpoint refused what the eager recomputation saved); Muon over
# ZeRO-1's bf16 parameters.
SAME_LAYOUT = [
    ("moe-ep2-documents", ["model.preset='tiny-moe'", "parallel.ep=2", "data.document_mask=true"]),
    ("fp16-cp2-ulysses-selective", ["train.precision=fp16", "parallel.cp=2",
                                    "parallel.cp_method='ulysses'",
                                    "train.activation_checkpointing=selective"]),
    ("muon-zero1-bf16", ["train.optimizer='muon'", "parallel.zero=1", "train.precision=bf16"]),
]


def eager_then_compiled(eager, compiled):
    from torch._dynamo.convert_frame import FRAME_COMPILE_COUNTER  # compilations per frame

    out = run_steps(eager), with_compile_counts(compiled)  # (which starts as a new process)
    out[1]["most_compiles"] = max(FRAME_COMPILE_COUNTER.values())
    return out


@pytest.mark.parametrize("overrides", [r[1] for r in SAME_LAYOUT], ids=[r[0] for r in SAME_LAYOUT])
def test_compiled_blocks_train_what_the_same_layout_trains_eager(overrides):
    for eager, compiled in run_world(eager_then_compiled, 2, config(*overrides),
                                     config(*AOT, *overrides), timeout=240):
        assert compiled["graphs"] > 0
        # No frame compiled again for each batch (at most once more: the document masks' cache
        # is filled on the first call). MoE's dispatch and the router's host reads of its
        # statistics were, until dynamo's limit of 8 (69 graphs in 4 steps): they run eager.
        assert compiled["most_compiles"] <= 2, compiled["most_compiles"]
        _equal([compiled], eager)


def test_inductor_compiled_blocks_train_what_eager_training_trains(reference):
    cfg = config("train.compile=true")
    _equal(run_world(run_steps, 1, cfg, timeout=240), reference)


def test_a_hugging_face_family_compiles_per_block(tmp_path):
    """transformers' own decoder layers, compiled one by one (the family's plan names them),
    against the transformers module trained eagerly in one process."""
    folder = write_model(tmp_path / "llama", "llama")
    ref = train_reference(folder, hf_config(folder))
    cfg = hf_config(folder, *AOT, "parallel.zero=3")
    results = run_world(run_steps, 2, cfg, timeout=240)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=0)


def test_auto_compiles_on_cuda_only():
    from plait.parallel.compile import compile_enabled

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not compile_enabled("auto", cpu) and compile_enabled("auto", cuda)
    assert compile_enabled(True, cpu) and not compile_enabled(False, cuda)


def test_a_forced_cpu_capability_compiles_into_a_cache_of_its_own(monkeypatch):
    """Inductor's disk cache does not key on the ISA it picks from ATEN_CPU_CAPABILITY: a block
    compiled natively on an AVX-512 CPU, then under ATEN_CPU_CAPABILITY=avx2, computed NaN."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from plait.parallel.compile import _cache_per_capability

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    _cache_per_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.abspath(default_cache_dir()) + "_avx2"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/mine")  # a user's folder is kept
    _cache_per_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/mine"
