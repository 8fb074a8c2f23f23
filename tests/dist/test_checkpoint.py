"""Checkpoints: resume is bit-exact on the same layout, and a checkpoint made on one layout
continues on another (resharding), equal to the uninterrupted run within reduction order."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_world
from training import assert_params_close, held_params, tiny_config

from plait.checkpoint import complete_checkpoints, read_meta
from plait.checkpoint.rank_state import load_full
from plait.mesh import build_mesh
from plait.train.checks import validate
from plait.train.trainer import Trainer

STEPS, STOP = 8, 4


def _setup(cfg):
    dims = validate(cfg, dist.get_world_size())
    return cfg, dims, build_mesh(dims), torch.device("cpu")


def _fit(cfg):
    trainer = Trainer(*_setup(cfg))
    return trainer, trainer.fit()


def _straight_then_resumed(layout, ckdir):
    """8 steps straight; 4 steps then a stop (saving); a new trainer resuming from it."""
    base = [*layout, f"train.steps={STEPS}", "train.warmup_steps=2"]
    trainer, straight = _fit(tiny_config(*base))
    want = held_params(trainer)
    _, first = _fit(tiny_config(*base, f"train.stop_after={STOP}", f"checkpoint.dir={ckdir}"))
    trainer, second = _fit(tiny_config(*base, f"checkpoint.dir={ckdir}"))
    return straight.losses, first.losses + second.losses, want, held_params(trainer), \
        trainer.start_step


LAYOUTS = {
    "ddp": (2, ["parallel.dp=2"]),
    "zero1": (2, ["parallel.zero=1"]),
    "zero2": (2, ["parallel.zero=2"]),
    "zero3-async": (2, ["parallel.zero=3", "checkpoint.async=true"]),
    "tp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp": (2, ["parallel.pp=2", "parallel.pp_schedule='1f1b'"]),
    "3d": (8, ["parallel.pp=2", "parallel.tp=2", "parallel.zero=1",
               "parallel.pp_schedule='interleaved'", "parallel.microbatches=2",
               "model.n_layers=4"]),
    "moe-ep2-dp2-zero1": (4, ["model.preset='tiny-moe'", "parallel.ep=2", "parallel.zero=1"]),
    # Muon's momentum (matrices) beside AdamW's moments (the rest), in ZeRO-3's slices.
    "muon-zero3": (2, ["parallel.zero=3", "train.optimizer='muon'"]),
    # SGD's momentum alone: no step count, the generator and the rest still saved.
    "sgd-zero1": (2, ["parallel.zero=1", "train.optimizer='sgd'"]),
    # Compression's state: top-k's error feedback; PowerSGD's errors and Q (one per tp slice),
    # under ZeRO-2. Started after 2 steps, so both uncompressed and compressed steps are saved.
    "ddp-topk": (2, ["parallel.dp=2", "parallel.compression='topk'",
                     "parallel.compression_start=2"]),
    "tp2-dp2-zero2-powersgd": (4, ["parallel.tp=2", "parallel.zero=2",
                                   "parallel.compression='powersgd'",
                                   "parallel.compression_rank=2",
                                   "parallel.compression_start=2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_is_bit_exact(name, tmp_path):
    world, layout = LAYOUTS[name]
    results = run_world(_straight_then_resumed, world, layout, str(tmp_path), timeout=240)
    for straight, resumed, want, got, start in results:
        assert start == STOP
        assert resumed == straight  # exactly: same layout, same reduction order
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), key
    saved = [p.name for p in complete_checkpoints(tmp_path)]
    assert saved == [f"step-{STOP:08d}", f"step-{STEPS:08d}"]
    assert read_meta(tmp_path / saved[0])["step"] == STOP


def _run(overrides, ckdir, *extra):
    """Train with `overrides`, checkpointing into `ckdir`; the losses of this run."""
    return _fit(tiny_config(*overrides, f"train.steps={STEPS}", "train.warmup_steps=2",
                            f"checkpoint.dir={ckdir}", *extra))[1].losses


RESHARD = {
    "zero3-dp4-to-dp2-tp2-zero1": ((4, ["parallel.zero=3"]),
                                   (4, ["parallel.tp=2", "parallel.zero=1"])),
    "3d-to-one-process": ((8, ["parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule='gpipe'"]),
                          (1, [])),
    "zero1-dp2-to-zero3-dp4": ((2, ["parallel.zero=1"]), (4, ["parallel.zero=3"])),
    "moe-ep2-to-ep4-zero3": ((2, ["model.preset='tiny-moe'", "parallel.ep=2"]),
                             (4, ["model.preset='tiny-moe'", "parallel.ep=4", "parallel.zero=3"])),
    # ZeRO-3 slices over the dp x cp ranks, resumed on another cp method and sharding group.
    "ring-cp2-zero3-to-ulysses-cp2-dp2-zero1": (
        (2, ["parallel.cp=2", "parallel.zero=3"]),
        (4, ["parallel.cp=2", "parallel.cp_method='ulysses'", "parallel.zero=1"])),
}


def _straight_and_resumed(tmp_path, n_a, a, n_b, b) -> tuple[list, list]:
    """The uninterrupted run on layout `a`, saving after step 4 on its way (the checkpoint a stop
    there writes: a save changes nothing of the run, `test_resume_is_bit_exact`), and the run
    resumed from that checkpoint on layout `b`; the losses of each."""
    straight = run_world(_run, n_a, a, str(tmp_path / "straight"), f"checkpoint.every={STOP}",
                         timeout=240)[0]
    start = tmp_path / "straight" / f"step-{STOP:08d}"
    resumed = run_world(_run, n_b, b, str(tmp_path / "run"), f"checkpoint.resume={start}",
                        timeout=240)[0]
    return straight, resumed


@pytest.mark.parametrize("name", list(RESHARD))
def test_resharded_resume_continues_the_run(name, tmp_path):
    """Saved after 4 steps on one layout, continued for 4 on another: the losses and the final
    parameters equal the uninterrupted run's on the first layout within fp32 reduction order
    (`training.assert_params_close`, as the composition matrix: a layout changes only the order
    of sums)."""
    (n_a, a), (n_b, b) = RESHARD[name]
    straight, resumed = _straight_and_resumed(tmp_path, n_a, a, n_b, b)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight[STOP:]),
                               rtol=1e-5, atol=0)
    want = load_full(tmp_path / "straight" / f"step-{STEPS:08d}")
    got = load_full(tmp_path / "run" / f"step-{STEPS:08d}")
    assert want.keys() == got.keys()
    for key in want:
        assert_params_close(got[key], want[key], key, steps=STEPS)
    assert read_meta(tmp_path / "run" / f"step-{STEPS:08d}")["world_size"] == n_b


def test_a_muon_checkpoint_of_zero3_resumes_at_tp2(tmp_path):
    """Muon's state (a momentum per matrix, sliced by ZeRO-3) read into tp2's shards: the run
    continues as the uninterrupted one, within Muon's tolerances (test_compositions.py's
    MUON_ROWS say why they are wider than AdamW's)."""
    muon = "train.optimizer='muon'"
    a, b = ["parallel.zero=3", muon], ["parallel.tp=2", muon]
    straight, resumed = _straight_and_resumed(tmp_path, 2, a, 2, b)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight[STOP:]),
                               rtol=1e-4, atol=0)
    saved = load_full(tmp_path / "straight" / f"step-{STOP:08d}", prefix="optim.")
    assert "momentum_buffer.layers.0.attention.wq.weight" in saved
    assert "exp_avg.tok_embeddings.weight" in saved
    assert not any(k.startswith("exp_avg.layers.0.attention.") for k in saved)
    want = load_full(tmp_path / "straight" / f"step-{STEPS:08d}")
    got = load_full(tmp_path / "run" / f"step-{STEPS:08d}")
    assert want.keys() == got.keys()
    for key in want:
        assert (got[key] - want[key]).abs().mean() <= 1e-4, key


def _summed_errors(overrides, ckdir):
    """A trainer on this layout resuming from `ckdir`: its error feedback, summed over the
    ranks of each reduction."""
    trainer = Trainer(*_setup(tiny_config(*overrides, f"checkpoint.dir={ckdir}")))
    engine, out = trainer.parallelized.engine, {}
    for buf in engine.flat_buffers():
        state = engine.compression.method.state_tensors(buf.key, buf.segments,
                                                        buf.full.numel(), torch.device("cpu"))
        for name, error in state["error"].items():
            out[name] = error.clone()
            dist.all_reduce(out[name], group=buf.group)
    return out


TOPK = ["parallel.compression='topk'", "parallel.compression_start=1"]
REDISTRIBUTE = {"dp4-to-dp2": ((4, []), (2, [])),
                "dp2-zero1-to-dp4": ((2, ["parallel.zero=1"]), (4, []))}


@pytest.mark.parametrize("name", list(REDISTRIBUTE))
def test_error_feedback_resumes_on_another_dp_degree(name, tmp_path):
    """Saved on n ranks, resumed on n': rank j takes rows j, j + n', ... of the saved errors, so
    their sum over the ranks, what the mean gradient has not yet received, is kept (to fp32
    summation order: the saved rows summed at once, and the rows each rank took summed, then
    all-reduced: each side rounds fewer than n + n' times, each rounding within 2^-24 of the sum
    of the terms' magnitudes; measured up to 3.5 of those) and no rank starts with another's
    error twice."""
    (n_a, a), (n_b, b) = REDISTRIBUTE[name]
    run_world(_run, n_a, [*TOPK, *a], str(tmp_path), f"train.stop_after={STOP}")
    saved = load_full(tmp_path / f"step-{STOP:08d}", "compression.error.")
    assert saved and all(e.shape[0] == n_a and e.abs().sum() > 0 for e in saved.values())
    got = run_world(_summed_errors, n_b, [*TOPK, *b], str(tmp_path))
    for sums in got:
        assert sums.keys() == saved.keys()
        for key, total in sums.items():
            bound = (n_a + n_b) * 2**-24 * saved[key].abs().sum(0)
            assert ((total - saved[key].sum(0)).abs() <= bound).all(), key
