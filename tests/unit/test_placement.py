"""The placement record catches an incomplete or wrong placement, and the dry run places a whole
model across ranks without a process group."""

import pytest

from plait.config.schema import load_config
from plait.mesh import AXES
from plait.model import build_model, model_args
from plait.parallel.placement import PlacementRecord
from plait.train.checks import validate
from plait.train.dry_run import describe_rank


def _record(coords=None):
    coords = coords or dict.fromkeys(AXES, 0)
    sizes = {**dict.fromkeys(AXES, 1), "tp": 2, "dp": 2}
    record = PlacementRecord(coords, sizes)
    record.add("w", (8, 4))
    record.add("norm", (4,))
    for name in ("w", "norm"):
        record.shard(name, "pp", None)
        for axis in ("cp", "ep"):
            record.replicate(name, axis)
        record.replicate(name, "dp", partial_grad=True)
    record.shard("w", "tp", 0)
    return record


def test_every_axis_exactly_once():
    record = _record()
    with pytest.raises(RuntimeError, match="placement of norm: axis tp recorded 0 times"):
        record.check()
    record.replicate("norm", "tp")
    record.check({"w": (4, 4), "norm": (4,)})
    record.replicate("w", "tp")
    with pytest.raises(RuntimeError, match="placement of w: axis tp recorded 2 times"):
        record.check()


def test_held_shapes_must_match():
    record = _record()
    record.replicate("norm", "tp")
    with pytest.raises(RuntimeError, match=r"w is \(8, 4\) here; its placement says \(4, 4\)"):
        record.check({"w": (8, 4), "norm": (4,)})
    with pytest.raises(RuntimeError, match="differ"):
        record.check({"w": (4, 4)})


def test_replicas_count_once_shards_everywhere():
    on_tp1 = _record({**dict.fromkeys(AXES, 0), "tp": 1})
    on_tp1.replicate("norm", "tp")
    assert on_tp1.counts_once("w", {"tp"}) and not on_tp1.counts_once("norm", {"tp"})
    assert on_tp1.counts_once("norm", set())  # not summed over tp: every rank has it all
    assert on_tp1.grad_sync_axes() == {"dp"}


def test_dry_run_places_the_whole_model_across_the_stages():
    cfg = load_config(None, ["model.preset=tiny", "model.n_layers=4", "parallel.pp=2",
                             "parallel.tp=2", "parallel.zero=1", "data.seq_len=32"])
    dims = validate(cfg, 8)
    full = dict(build_model(model_args("tiny", n_layers=4), 0, "meta").named_parameters())
    held = [describe_rank(cfg, dims, rank) for rank in range(8)]
    # Stages hold disjoint halves; each tp pair holds the stage's parameters in halves (norms
    # whole); dp replicas hold the same.
    assert held[0]["chunks"] == [0] and held[4]["chunks"] == [1]
    per_pipeline = sum(h["elements"] for h in held if h["coords"]["dp"] == 0)
    norms = sum(p.numel() for n, p in full.items() if n.endswith("norm.weight"))
    assert per_pipeline == sum(p.numel() for p in full.values()) + norms  # norms twice over tp
    assert held[1]["traffic"].total == held[0]["traffic"].total > 0
