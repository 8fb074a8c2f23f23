"""Hugging Face models (the transformers modules themselves, `model.hf = DIR`) in the
composition matrix: each row trains 4 steps through plait's trainer and equals the same
transformers model trained in one process on the same global batches (`hf_models.py`): the
losses, and every parameter after the steps (tensor-parallel shards against the same slice of the
reference). The rows that run plait's formulas also check this rank's collectives of the last
step against `plait.predict.cost`, exactly, and against what `plait train --dry-run` predicts
for the rank from one process: its model state, and its activation bytes, traced on fake tensors
(Mixtral's routing, which depends on values a fake tensor does not hold, is traced as even:
equal per rank at tp2, and per ep group's sum under ep).

Tolerance, as the composition matrix's: float32, the reductions sum in another order than one
process's backward. Losses relative 1e-5; parameters by `assert_params_close` (the reasons are
in the helper).
"""

from __future__ import annotations

import corpora
import pytest
import torch
from harness import run_world
from hf_models import hf_config, reference_of, train_reference, write_model
from training import assert_params_close, run_steps

from plait.train.checks import validate
from plait.model.families import family_for, family_of
from plait.model.hf import architecture, hf_name, read_config
from plait.planner.price import estimate
from plait.planner.hardware import DEVICES, Cluster
from plait.train.dry_run import describe_rank

STEPS = 4

PLANNED = ("mistral", "gemma", "gemma2", "stablelm", "starcoder2", "gpt-neox", "olmo2", "phi3",
           "gpt2", "falcon")
# (id, family, ranks, overrides)
ROWS = [
    ("llama-dp2-tp2-zero1", "llama", 4, ["parallel.tp=2", "parallel.zero=1"]),
    ("llama-pp2-tp2-sp-interleaved", "llama", 4,
     ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
      "parallel.pp_schedule=interleaved", "parallel.microbatches=4"]),
    ("llama-hsdp-zero3-dp4-shard2", "llama", 4, ["parallel.zero=3", "parallel.dp_shard=2"]),
    ("llama-dp2-ac-selective", "llama", 2, ["train.activation_checkpointing=selective"]),
    ("llama-cp2-ring", "llama", 2, ["parallel.cp=2"]),
    ("llama-dp2-cp2-ulysses", "llama", 4, ["parallel.cp=2", "parallel.cp_method=ulysses"]),
    ("qwen2-tp2", "qwen2", 2, ["parallel.tp=2"]),
    ("llama-tied-dp2-zero3", "llama-tied", 2, ["parallel.zero=3"]),
    # ZeRO-3 units below a decoder layer: its attention and its MLP (a wrap policy on a planned
    # family); the norms, the embedding and the head left over, gathered for the whole forward.
    ("llama-dp2-zero3-sub-block", "llama", 2, ["parallel.zero=3",
                                               "parallel.wrap=LlamaAttention,LlamaMLP"]),
    ("llama-tied-tp2-sp", "llama-tied", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("qwen3-tp2-sp", "qwen3", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("mixtral-ep2-dp2", "mixtral", 4, ["parallel.ep=2"]),
    # Hybrid sharding with cp (a shard group: a dp rank's 2 cp ranks) and with ep (the dense
    # parameters over a dp rank's 2 ep ranks, each expert over its dp rank alone).
    ("llama-dp2-cp2-hsdp-zero3-shard1", "llama", 4, ["parallel.cp=2", "parallel.zero=3",
                                                     "parallel.dp_shard=1"]),
    ("mixtral-ep2-dp2-hsdp-zero1-shard1", "mixtral", 4, ["parallel.ep=2", "parallel.zero=1",
                                                         "parallel.dp_shard=1"]),
    ("mixtral-tp2", "mixtral", 2, ["parallel.tp=2"]),
    # The other planned families (`plait/model/families/`): each under tp2 + sp with pp2, and
    # under ZeRO-3 (Gemma2: soft-capped scores in its eager attention, soft-capped logits).
    *[row for family in PLANNED for row in (
        (f"{family}-pp2-tp2-sp", family, 4, ["parallel.pp=2", "parallel.tp=2",
                                             "parallel.sequence_parallel=true"]),
        (f"{family}-zero3", family, 2, ["parallel.zero=3"]))],
    ("bloom-dp2-alibi", "bloom", 2, []),
    # A family with no plan recomputes each decoder layer (its _no_split_modules) under "full".
    ("bloom-dp2-zero3-ac-full", "bloom", 2, ["parallel.zero=3",
                                             "train.activation_checkpointing=full"]),
]
# Document masking (`data.document_mask`) on a corpus of short documents, against transformers'
# packed sequences (its mask made from the positions, which restart at each document).
DOCUMENT_ROWS = [
    ("llama-documents-tp2-sp-pp2", "llama", 4, ["parallel.tp=2", "parallel.pp=2",
                                                "parallel.sequence_parallel=true"]),
    ("llama-documents-cp2-ring", "llama", 2, ["parallel.cp=2"]),
    ("qwen3-documents-cp2-ulysses", "qwen3", 2, ["parallel.cp=2", "parallel.cp_method=ulysses"]),
    # Falcon's attention is its own (SDPA called in its module): the documents' mask is given
    # to it; its first layout (q, k, v per head, biases) split by tp.
    ("falcon-classic-documents-tp2", "falcon-classic", 2, ["parallel.tp=2"]),
]
LLAMA = family_of("LlamaForCausalLM")
# The cost formulas price plait's own mixture of experts; transformers' experts' all-to-alls
# depend on its routing and are not in them.
NO_FORMULA = {"mixtral"}


def _held(whole: torch.Tensor, placement) -> torch.Tensor:
    """The part of a reference tensor a rank holds: its tp shard, and for stacked experts its
    rows over ep."""
    for axis in ("tp", "ep"):
        shard = placement[1].get(axis)
        if shard is not None and shard.dim is not None:
            whole = whole.chunk(shard.count, dim=shard.dim)[shard.index]
    return whole


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {f: write_model(root / f, f) for f in {row[1] for row in (*ROWS, *DOCUMENT_ROWS)}}


@pytest.fixture(scope="module")
def references(folders):
    """One single-process transformers run per family, shared by its rows."""
    return {f: train_reference(folders[f], hf_config(folders[f]), STEPS)
            for f in {row[1] for row in ROWS}}


def test_hf_model_in_bf16_tracks_transformers_in_one_process(folders):
    """bf16 autocast over fp32 weights (plait's DDP and ZeRO-0 bf16) at dp2 x tp2, against the
    transformers model under the same autocast in one process. Tolerance as the composition
    matrix's bf16 rows: losses 1e-3 relative, each tensor's mean absolute difference 3e-4 (bf16
    keeps 8 bits; a missed or doubled update moves every element by ~lr = 3e-3)."""
    cfg = hf_config(folders["llama"], "train.precision=bf16", "parallel.tp=2")
    ref = train_reference(folders["llama"], cfg, STEPS)
    for r in run_world(run_steps, 4, cfg, STEPS, timeout=240):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-3, atol=0)
        for name, p in r["params"].items():
            want = _held(ref["params"][hf_name(name, LLAMA)], r["placements"][name])
            assert (p.float() - want.float()).abs().mean() <= 3e-4, name


@pytest.mark.parametrize("family,ranks,overrides", [r[1:] for r in ROWS],
                         ids=[r[0] for r in ROWS])
def test_hf_model_equals_transformers_in_one_process(folders, references, family, ranks,
                                                     overrides):
    cfg = hf_config(folders[family], *overrides)
    results = _equals_reference(cfg, family, ranks, references[family])
    if "train.activation_checkpointing=full" in overrides:  # recomputed: less is kept
        plain = hf_config(folders[family], *(o for o in overrides if "activation" not in o))
        kept = describe_rank(plain, validate(plain, ranks), 0)["activations"]
        assert all(r["activation_bytes"] < kept for r in results), kept


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    return corpora.short_documents(tmp_path_factory.mktemp("short-documents"))


def _documents_config(folder, source, *overrides):
    return hf_config(folder, f"data.source='{source}'", "data.max_bytes=0",
                     "data.document_mask=true", *overrides)


@pytest.fixture(scope="module")
def document_references(folders, short_documents):
    return {f: train_reference(folders[f], _documents_config(folders[f], short_documents), STEPS)
            for f in {row[1] for row in DOCUMENT_ROWS}}


@pytest.mark.parametrize("family,ranks,overrides", [r[1:] for r in DOCUMENT_ROWS],
                         ids=[r[0] for r in DOCUMENT_ROWS])
def test_hf_document_mask_equals_transformers_packed_sequences(
        folders, short_documents, document_references, family, ranks, overrides):
    cfg = _documents_config(folders[family], short_documents, *overrides)
    _equals_reference(cfg, family, ranks, document_references[family])


def _equals_reference(cfg, family: str, ranks: int, ref: dict) -> list[dict]:
    """`cfg` trained on `ranks` ranks equals `ref` (losses, parameters), with its collectives,
    model state and activations as predicted."""
    results = run_world(run_steps, ranks, cfg, STEPS, timeout=240)
    dims = validate(cfg, ranks)
    planned = family_for(read_config(cfg.model.hf))  # None: no plan
    seen, measured, traced = set(), {}, {}
    for r in results:
        # What `plait train --dry-run` says of this rank from one process, on `meta`.
        dry = describe_rank(cfg, dims, r["rank"])
        # Activations: the rank's step traced on fake tensors (`plait.predict.trace`), the
        # transformers model's own operations, planned or not (Mixtral's experts routed evenly:
        # what they keep is linear in each expert's rows, `plait/predict/routing.py`).
        assert dry["untraced"] is None
        if dims.ep == 1:
            assert dry["activations"] == r["activation_bytes"], f"rank {r['rank']}: activations"
        else:  # the experts' rows follow the routing: an ep group's sum is the trace's
            coords = dims.coords(r["rank"])
            group = tuple(v for axis, v in coords.items() if axis != "ep")
            measured[group] = measured.get(group, 0) + r["activation_bytes"]
            traced[group] = traced.get(group, 0) + dry["activations"]
        if family not in NO_FORMULA:
            assert r["ledger"] == r["traffic"], f"rank {r['rank']}: collectives vs formulas"
            assert (dict(dry["traffic"].calls), dry["traffic"].bytes) == r["ledger"]
            assert dry["state"] == r["state"], f"rank {r['rank']}: model state"
            if r["rank"] == 0:  # a pinned plan prices the same
                plan = estimate(cfg, dims, Cluster(ranks, ranks, DEVICES["a100"]))
                assert plan.memory_bytes["activations"] == r["activation_bytes"]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=0)
        for name, p in r["params"].items():
            whole, hf = reference_of(name, planned, ref["params"], cfg.model.hf)
            assert_params_close(p, _held(whole, r["placements"][name]), name, steps=STEPS)
            seen.add(hf)
    # Every parameter of the transformers model was trained somewhere (a tied head counts once).
    assert seen == set(ref["params"])
    assert measured == traced
    return results
