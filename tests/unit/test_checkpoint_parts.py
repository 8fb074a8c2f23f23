"""The parts of checkpointing that need no processes: the boxes a flat range covers, which
checkpoint `auto` finds, what is kept, and how a resume adapts to another world size."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.checkpoint import MARKER, META, complete_checkpoints, find, finish, step_path
from plait.checkpoint.layout import range_boxes
from plait.config.schema import load_config
from plait.train.elastic import fit_world


@st.composite
def shape_and_range(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    n = math.prod(shape)
    start = draw(st.integers(0, n))
    return shape, start, draw(st.integers(start, n))


@settings(max_examples=300, deadline=None)
@given(shape_and_range())
def test_range_boxes_cover_the_range_once_in_order(case):
    """Each element of [start, stop) lies in exactly one box, nothing else does, boxes come in
    memory order, and each box is one contiguous run of memory (so a flat slice views it)."""
    shape, start, stop = case
    flat = torch.arange(math.prod(shape)).view(shape)
    covered, at = [], start
    for (offsets, sizes), first in range_boxes(shape, start, stop):
        assert first == at and len(offsets) == len(sizes) == len(shape)
        box = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        assert box.flatten().tolist() == list(range(first, first + box.numel()))  # contiguous
        covered += box.flatten().tolist()
        at += box.numel()
    assert covered == list(range(start, stop))
    assert len(range_boxes(shape, start, stop)) <= 2 * len(shape) - 1


def _checkpoint(root, step, complete=True, world=2, model=None):
    path = step_path(root, step)
    path.mkdir(parents=True)
    meta = {"step": step, "world_size": world, "contents": ["model", "optim", "train"],
            "config": {"model": model or {"preset": "tiny"}}}
    if complete:
        finish(path, meta)
    return path


def test_auto_finds_the_newest_complete_checkpoint(tmp_path):
    _checkpoint(tmp_path, 2)
    newest = _checkpoint(tmp_path, 4)
    _checkpoint(tmp_path, 6, complete=False)  # a save that crashed
    assert find("auto", str(tmp_path)) == newest
    assert find(str(tmp_path), "") == newest  # a folder of checkpoints
    assert find(str(newest), "") == newest  # a checkpoint
    assert find("never", str(tmp_path)) is None
    assert find("auto", "") is None and find("auto", str(tmp_path / "none")) is None


def test_finish_writes_the_marker_last_and_keeps_the_newest(tmp_path):
    for step in (2, 4):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 5, complete=False)
    path = _checkpoint(tmp_path, 6, complete=False)
    finish(path, {"step": 6}, keep=2)
    assert (path / MARKER).is_file() and json.loads((path / META).read_text()) == {"step": 6}
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000004", "step-00000006"]
    assert not step_path(tmp_path, 5).exists()  # an unfinished save older than the newest


@pytest.mark.parametrize("world,batch,lr,microbatches,notes", [
    # Saved at dp 2: 4 rows per rank in 2 micro-batches of 2 sequences.
    (2, 8, 1e-3, 2, 0),  # the same world: nothing changes
    (4, 8, 1e-3, 1, 2),  # dp 4: 2 rows per rank, one micro-batch of 2
    (3, 6, 0.75e-3, 1, 3),  # dp 3 does not divide 8: batch 6, LR * 6 / 8, 1 micro-batch of 2
    (1, 8, 1e-3, 4, 2),  # dp 1: 8 rows per rank, 4 micro-batches of 2
])
def test_a_resume_on_another_world_keeps_the_run(tmp_path, world, batch, lr, microbatches,
                                                   notes):
    _checkpoint(tmp_path, 4, world=2)
    cfg = load_config(None, ["model.preset=tiny", "train.global_batch=8", "train.lr=1e-3",
                             "parallel.microbatches=2", f"checkpoint.dir={tmp_path}"])
    fitted, said = fit_world(cfg, world)
    assert fitted.train.global_batch == batch
    assert fitted.train.lr == pytest.approx(lr)
    assert fitted.parallel.microbatches == microbatches
    assert len(said) == notes
