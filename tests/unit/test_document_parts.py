"""Document masking (`data.document_mask`, model/documents.py) in one process: a window holding
documents A and B gives A's tokens the logits of A alone and B's those of B alone, for plait's
Llama and for transformers' families under plait (against the transformers module run on each
document alone); and the positions and masks a window's boundaries make.

Tolerance: fp32 on the CPU, 1e-5 absolute on logits of magnitude ~1: the window's attention is
one masked SDPA over more keys than each document's own causal one, so its sums run in another
order (measured ~1e-6 on AVX-512 and on an AMD EPYC).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait.model import build_model, model_args
from plait.model.documents import Documents

A, B = 11, 15  # document lengths in a window of 32 (then 6 tokens of a third)


def _window(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(2, 32) tokens and their documents: row 0 holds A then B then the start of C; row 1 is one
    document (no boundary: the mask is the causal one)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (2, 32), generator=gen)
    ids = torch.zeros(2, 32, dtype=torch.int64)
    ids[0, A:] = 1
    ids[0, A + B :] = 2
    return tokens, ids


def test_positions_restart_and_the_mask_is_block_diagonal_causal():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    docs = Documents.whole(ids)
    assert docs.positions().tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    mask = docs.mask()[:, 0]
    assert mask[0].tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    assert torch.equal(mask[1], torch.ones(6, 6, dtype=torch.bool).tril())
    # A rank holding positions 1 and 4 (a cp shard) sees their positions and their mask against
    # any keys of the window.
    shard = docs.shard(torch.tensor([1, 4]))
    assert shard.positions().tolist() == [[1, 1], [1, 4]]
    assert shard.mask(keys=torch.tensor([0, 3]))[0, 0].tolist() == [[1, 0], [0, 1]]


def test_llama_gives_each_document_of_a_window_the_logits_it_has_alone():
    args = model_args("tiny")
    model = build_model(args, seed=0).eval()
    tokens, ids = _window(args.vocab_size)
    with torch.no_grad():
        packed = model(tokens, Documents.whole(ids))
        for lo, hi in ((0, A), (A, A + B), (A + B, 32)):
            alone = model(tokens[:1, lo:hi])
            torch.testing.assert_close(packed[0, lo:hi], alone[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(packed[1], model(tokens[1:])[0], rtol=0, atol=1e-5)
    # Without the mask the second document's logits are not its own: the test can fail.
    assert not torch.allclose(model(tokens)[0, A : A + B], packed[0, A : A + B], atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral"])
def test_a_transformers_model_gives_each_document_its_logits_alone(tmp_path, family):
    pytest.importorskip("transformers")
    from hf_models import write_model

    from plait.model.hf import load_hf, transformers_model

    folder = write_model(tmp_path / family, family)
    ours, theirs = load_hf(folder).eval(), transformers_model(folder).eval()
    tokens, ids = _window(ours.args.vocab_size)
    documents = Documents.whole(ids)
    with torch.no_grad():
        packed = ours(tokens, documents=documents)
        for lo, hi in ((0, A), (A, A + B), (A + B, 32)):
            alone = theirs(input_ids=tokens[:1, lo:hi], use_cache=False).logits
            torch.testing.assert_close(packed[0, lo:hi], alone[0], rtol=0, atol=1e-5)
        # transformers' own packed sequences (its mask made from positions that restart), the
        # reference of the multi-process rows (tests/hf_models.py).
        theirs_packed = theirs(input_ids=tokens, position_ids=documents.positions(),
                               use_cache=False).logits
        torch.testing.assert_close(packed, theirs_packed, rtol=0, atol=1e-5)


def test_the_mask_is_kept_for_backward_once_not_per_layer():
    """Attention saves its mask for backward; every layer of a forward gets the same additive
    mask (`Documents.additive`), so the saved activations grow by one (rows, 1, seq, seq) fp32
    mask whatever the depth (counted by storage, as `--dry-run` and the trainer count them),
    and the rotary tables of positions that are now per row."""
    from plait.predict.activation_memory import SavedActivations

    args = model_args("tiny")
    tokens, ids = _window(args.vocab_size)
    saved = {}
    for layers in (2, 4):
        model = build_model(dataclasses.replace(args, n_layers=layers), seed=0)
        for docs in (None, Documents.whole(ids)):
            counter = SavedActivations(model)
            with counter:
                out = model(tokens) if docs is None else model(tokens, docs)
            saved[layers, docs is None] = counter.peak
            del out
    rows = tokens.shape[0]
    one_mask = rows * 32 * 32 * 4
    tables = 2 * (rows - 1) * 32 * (args.head_dim // 2) * 4  # cos and sin per row, not shared
    assert saved[2, False] - saved[2, True] == one_mask + tables
    assert saved[4, False] - saved[4, True] == one_mask + tables
