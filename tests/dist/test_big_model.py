"""A model larger than what a rank may hold: at ZeRO-3 over 8 ranks, no rank's peak resident
memory while it builds its part exceeds its baseline plus `cost.startup_bytes` (+ 16 MiB), and
from before the model is built through its first training step, none exceeds the
interpreter's baseline plus the formula's peak model state (`cost.state_bytes`: its slices, the
units gathered at once, the gradient staging in flight) plus the step's activations plus 16 MiB
(allocator and gloo buffers) -- a bound below the whole model's fp32 size, so no rank ever held
the model whole. Peak memory is the process's own count (VmHWM, restarted once the process
group is up and a tiny model has trained a step, so that the modules the trainer imports are in
the baseline). Before #30 each rank built the whole model first and staged its whole gradient."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from harness import run_world
from training import tiny_config

from plait.checks import validate
from plait.mesh import build_mesh
from plait.model import build_model
from plait.parallel import cost
from plait.train.host_memory import (
    peak_resident_bytes,
    release_freed_memory,
    reset_peak,
    resident_bytes,
)
from plait.train.trainer import Trainer

MiB = 2**20
# 24 blocks of dim 512: 76M parameters, 291 MiB in fp32; a unit (one block) is 12 MiB.
MODEL = ["model.n_layers=24", "model.dim=512", "model.n_heads=8", "model.n_kv_heads=8",
         "data.seq_len=2", "train.global_batch=8", "parallel.zero=3"]


def _first_step_peak(cfg):
    dims = validate(cfg, dist.get_world_size())
    mesh = build_mesh(dims)
    release_freed_memory()  # as `plait train` does for ZeRO-3 on the CPU
    # The baseline: the interpreter with everything the trainer imports (a tiny model's run).
    Trainer(tiny_config("parallel.zero=3"), dims, mesh, torch.device("cpu")).train_step(0)
    gc.collect()
    reset_peak()
    baseline = resident_bytes()
    trainer = Trainer(cfg, dims, mesh, torch.device("cpu"))
    built = peak_resident_bytes() - baseline
    result = trainer.train_step(0)
    state = trainer.parallelized.state_bytes(trainer.optimizer)
    return {"built": built, "startup": cost.startup_bytes(cfg, dims, trainer.parallelized.record),
            "grown": peak_resident_bytes() - baseline, "state_peak": state["peak"],
            "activations": result["activation_bytes"]}


def test_no_rank_holds_the_whole_model_at_zero3_dp8():
    cfg = tiny_config(*MODEL)
    whole = 4 * sum(p.numel() for p in build_model(cfg.model.args(), 0, "meta").parameters())
    for rank, r in enumerate(run_world(_first_step_peak, 8, cfg)):
        bound = r["state_peak"] + r["activations"] + 16 * MiB
        assert bound < whole, "the model is too small to show anything"
        assert r["built"] <= r["startup"] + 16 * MiB, f"rank {rank}: building it"
        assert r["grown"] <= bound, \
            f"rank {rank}: {r['grown'] / MiB:.1f} MiB over its baseline, bound {bound / MiB:.1f}"
