"""Document masking (`data.document_mask`) under the parallelisms that touch attention or
positions: tp (+ sp), pp, cp ring and Ulysses, alone and composed, each trained 4 steps from the
same weights and global batches as one process with the same mask (the composition matrix's
`compare`: losses relative 1e-5, parameters absolute 1e-5, the ledger, model state and
activations equal to their formulas and to `--dry-run`'s trace on every rank).

The corpus is a folder of short files (each file a document, 3 to 40 bytes), so that nearly every
window of 32 tokens holds a boundary and the ring's blocks include fully masked ones, which it
skips. A row without the mask on the same data shows that the mask changes the training.
"""

from __future__ import annotations

import corpora
import pytest
import torch
from harness import run_world
from test_compositions import compare, config
from training import run_steps

# (id, ranks, overrides)
ROWS = [
    ("tp2-sp", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("pp2-interleaved", 2, ["parallel.pp=2", "parallel.pp_schedule=interleaved"]),
    ("ring-cp2", 2, ["parallel.cp=2"]),
    ("ulysses-cp2", 2, ["parallel.cp=2", "parallel.cp_method=ulysses"]),
    ("ring-cp2-zero3", 2, ["parallel.cp=2", "parallel.zero=3"]),
    ("ring-cp2-tp2-ac-selective", 4, ["parallel.cp=2", "parallel.tp=2",
                                      "train.activation_checkpointing=selective"]),
    ("ulysses-cp2-pp2-zero1", 4, ["parallel.cp=2", "parallel.cp_method=ulysses",
                                  "parallel.pp=2", "parallel.zero=1"]),
]


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    return corpora.short_documents(tmp_path_factory.mktemp("short-documents"))


def _config(source, *overrides):
    return config(f"data.source='{source}'", "data.max_bytes=0", "data.document_mask=true",
                  *overrides)


@pytest.fixture(scope="module")
def reference(short_documents):
    return run_world(run_steps, 1, _config(short_documents))[0]


@pytest.mark.parametrize("ranks,overrides", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_document_mask_equals_one_process(short_documents, reference, ranks, overrides):
    cfg = _config(short_documents, *overrides)
    compare(cfg, run_world(run_steps, ranks, cfg, timeout=240), reference, 1e-5, 1e-5)


def test_the_mask_changes_what_is_trained(short_documents, reference):
    unmasked = run_world(run_steps, 1, _config(short_documents, "data.document_mask=false"))[0]
    assert not torch.allclose(torch.tensor(unmasked["losses"]),
                              torch.tensor(reference["losses"]), rtol=1e-3)
