"""Models built on `meta`, each rank materializing only what it holds (`plait.model.materialize`):
right after the trainer is built, every rank's parameters equal the part it holds of the
one-process model, bit for bit (the same generator draws the same rows, or the same file's
bytes are read), for ZeRO-3 slices, tensor-parallel slices, pipeline stages and a Hugging Face
folder read by slices. The embedding and head here are larger than one draw block (2^20
elements: 20,000 x 64), so slices start and end inside blocks and cross block boundaries."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_world
from hf_models import hf_config, write_model
from training import held_params, tiny_config

from plait.train.checks import validate
from plait.mesh import build_mesh
from plait.model import build_configured
from plait.model.llama import BLOCK
from plait.train.trainer import Trainer

WIDE = ["model.n_layers=4", "model.vocab_size=20000"]


def _built(cfg):
    """This rank's parameters right after construction (ZeRO-3: its units gathered whole), with
    how tensor and expert parallelism split each one."""
    dims = validate(cfg, dist.get_world_size())
    trainer = Trainer(cfg, dims, build_mesh(dims), torch.device("cpu"))
    record = trainer.parallelized.record
    return {n: (t, [record.params[n].shards.get(a) for a in ("tp", "ep")])
            for n, t in held_params(trainer).items()}


def _check(results, whole: dict[str, torch.Tensor]) -> None:
    seen = set()
    for held in results:
        for name, (tensor, shards) in held.items():
            want = whole[name]
            for shard in shards:
                if shard is not None and shard.dim is not None:
                    want = want.chunk(shard.count, dim=shard.dim)[shard.index]
            assert torch.equal(tensor, want), name
            seen.add(name)
    assert seen == set(whole)  # every parameter is held somewhere


@pytest.mark.parametrize("ranks,overrides", [
    (4, ["parallel.zero=3"]),
    (8, ["parallel.pp=2", "parallel.tp=2"]),
], ids=["zero3-dp4", "dp2-tp2-pp2"])
def test_each_rank_materializes_the_one_process_init(ranks, overrides):
    cfg = tiny_config(*WIDE, *overrides)
    whole = build_configured(cfg.model.args(), cfg.train.seed)
    assert whole.tok_embeddings.weight.numel() > BLOCK  # drawn in more than one block
    _check(run_world(_built, ranks, cfg), dict(whole.named_parameters()))


@pytest.mark.parametrize("family,ranks,overrides", [
    ("llama", 2, ["parallel.tp=2"]),
    # Mixtral's file holds each expert apart; the modules stack them: each ep rank reads its own.
    ("mixtral", 2, ["parallel.ep=2"]),
    # Held otherwise than filed: Phi3's fused qkv and gate-up projections, one linear per part
    # (each part's rows of the file's tensor); GPT-2's Conv1Ds as linears (their columns).
    ("phi3", 2, ["parallel.tp=2"]),
    ("gpt2", 2, ["parallel.tp=2"]),
])
def test_a_hugging_face_folder_is_read_by_slices(tmp_path, family, ranks, overrides):
    from plait.model.hf import load_hf, load_hf_sharded

    folder = write_model(tmp_path / family, family)
    assert load_hf_sharded(folder) is not None  # by slices, not built whole on each rank
    cfg = hf_config(folder, *overrides)
    results = run_world(_built, ranks, cfg)
    # transformers' from_pretrained reads the whole file; load_hf holds its modules as plait
    # does (parts apart, Conv1Ds as linears): the one-process model by plait's names.
    whole = {n: p.detach() for n, p in load_hf(folder).named_parameters()}
    _check(results, whole)
