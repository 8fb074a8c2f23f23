"""fp16 with dynamic loss scaling in the composition matrix: each row trains 4 steps, with an
overflow injected on one rank only in step 1, and is compared with one process running torch's
own recipe (autocast + `torch.amp.GradScaler`, `training.grad_scaler_reference`).

Settings: the scale starts at 2^14 and doubles after 2 clean steps, so 4 steps see all of its
rule: step 0 clean, step 1 overflows (skipped, 2^13), steps 2-3 clean (2^14 again). The start
leaves a margin of 16 below this model's natural overflows at 4 steps (none up to 2^18 at dp1
and dp2, measured), so only the injected one counts, on every layout alike.

What must be equal exactly: on every rank, the scale after each step and the skipped steps (one
decision for the job: the overflow on one tensor-parallel slice, one pipeline stage, one expert
rank or one sequence shard makes every rank skip), and the accounting the matrix asserts for
every row. What within a tolerance: the global norm of the unscaled gradient (AdamW's update is
nearly blind to a gradient's scale, so this is what shows a wrong unscaling: a factor 2 moves it
by 100%; we allow 1e-3 relative), losses and parameters as the bf16 rows (test_compositions;
fp16 keeps 11 significant bits to bf16's 8). Measured here: losses within 1.2e-5 relative,
per-tensor mean absolute parameter differences within 3.3e-5; we allow 1e-3 and 3e-4, ten times
below the ~lr = 3e-3 by which a missed or doubled update moves every element (as the skipped
step's update would, applied).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from harness import run_world
from matrix import STEPS, compare
from training import grad_scaler_reference, overflow_at, run_steps, tiny_config

from plait.train.checks import validate
from plait.mesh import build_mesh
from plait.parallel.expert_parallel import moe_layers
from plait.predict import cost
from plait.train.outputs import Outputs
from plait.train.trainer import NonFiniteGradient, Trainer

BASE = ["model.n_layers=4", "train.warmup_steps=2", f"train.steps={STEPS}",
        "train.precision=fp16", "train.loss_scale_init=16384", "train.loss_scale_growth_interval=2"]
MOE = ["model.preset='tiny-moe'"]
STEP = 1  # the step that overflows

# (id, ranks, overrides, (module, {axis: coordinate}) where the overflow is injected)
ROWS = [
    ("dp2-fp16", 2, [], ("layers.2.feed_forward.w2", {"dp": 1})),
    ("dp2-zero1-fp16", 2, ["parallel.zero=1"], ("layers.0.attention.wo", {"dp": 0})),
    # fp16 parameters under DDP (fp32 masters and gradient sums): the skipped step leaves
    # nothing in the sums for the next one
    ("dp2-fp16-params", 2, ["train.param_dtype=fp16"], ("layers.2.feed_forward.w2", {"dp": 1})),
    ("dp2-zero2-fp16", 2, ["parallel.zero=2"], ("layers.3.attention.wo", {"dp": 1})),
    ("dp2-zero3-fp16", 2, ["parallel.zero=3"], ("layers.1.feed_forward.w2", {"dp": 0})),
    ("3d-zero1-fp16", 8, ["parallel.pp=2", "parallel.tp=2", "parallel.zero=1"],
     ("layers.1.attention.wo", {"pp": 0, "tp": 1, "dp": 1})),  # one slice of the first stage
    ("cp2-fp16", 2, ["parallel.cp=2"], ("layers.1.attention.wo", {"cp": 1})),
    ("ep2-fp16", 2, [*MOE, "parallel.ep=2"], ("layers.0.feed_forward", {"ep": 1})),  # one
    # expert rank's tokens and experts
]


def injected(module: str, where: dict):
    """The probe: `module`'s output gradient overflows in step STEP on the ranks at `where`;
    returns each step's scale and the skipped steps."""

    def install(trainer):
        now, scales, norms, train_step = [0], [], [], trainer.train_step
        coords = trainer.dims.coords(dist.get_rank())
        here = all(coords[a] == c for a, c in where.items())
        if here:
            for chunk in trainer.model.values():
                try:
                    overflow_at(chunk.get_submodule(module), STEP, now)
                except AttributeError:
                    continue  # on another pipeline stage's chunk

        def step(i):
            now[0] = i
            out = train_step(i)
            scales.append(trainer.scaler.scale)
            norms.append(out["grad_norm"])
            return out

        trainer.train_step = step
        layers = [m for chunk in trainer.model.values() for m in moe_layers(chunk).values()]
        return lambda: {"scales": scales, "norms": norms, "skipped": trainer.scaler.skipped,
                        "injected": here,
                        # the last step's token rows each all-to-all moved (ep)
                        "rows": [r for m in layers for r in getattr(m.dispatch, "rows", [])]}

    return install


@pytest.fixture(scope="module")
def references():
    """torch's recipe in one process, shared by the rows: autocast over fp32 parameters (DDP,
    tp, cp, ep rows), fp16 parameters with fp32 masters (ZeRO rows), the MoE model."""
    out = {}
    for key, extra, half in (("dense", [], False), ("zero", [], True), ("moe", MOE, False)):
        cfg = tiny_config(*BASE, *extra)
        module = "layers.0.feed_forward" if key == "moe" else "layers.0.attention.wo"
        out[key] = grad_scaler_reference(cfg, STEPS, (module, STEP), half)
    return out


def test_the_reference_overflows_once_and_grows_back(references):
    for ref in references.values():
        assert ref["scales"] == [2.0**14, 2.0**13, 2.0**13, 2.0**14]
        assert ref["skipped"] == 1


@pytest.mark.kernels
@pytest.mark.parametrize("ranks,overrides,where", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_fp16_composition_tracks_grad_scaler(references, ranks, overrides, where):
    cfg = tiny_config(*BASE, *overrides)
    half = cost.half_params(cfg)  # fp16 parameters and fp32 masters, as ZeRO holds them
    ref = references["moe" if cfg.model.args().moe_experts else "zero" if half else "dense"]
    results = run_world(run_steps, ranks, cfg, STEPS, injected(*where), timeout=240)
    assert sum(r["probe"]["injected"] for r in results) == 1  # one rank overflowed
    for r in results:  # and every rank skipped that step and halved its scale
        assert r["probe"]["scales"] == ref["scales"], f"rank {r['rank']}"
        assert r["probe"]["skipped"] == ref["skipped"] == 1, f"rank {r['rank']}"
        # AdamW's update hardly sees a gradient's scale; the norm does (unscaling, clipping).
        got, want = torch.tensor(r["probe"]["norms"]), torch.tensor(ref["norms"])
        assert not got[STEP].isfinite() and not want[STEP].isfinite()
        torch.testing.assert_close(got[got.isfinite()], want[want.isfinite()], rtol=1e-3, atol=0)
    compare(cfg, results, ref, 1e-3, param_mean_atol=3e-4)


def _fit_fp16(overrides, ckdir, metrics, where):
    """Train with `overrides` from (or into) `ckdir`, the overflow injected as the rows do."""
    cfg = tiny_config(*BASE, "train.steps=6", "train.eval_batches=1", f"checkpoint.dir={ckdir}",
                      *overrides)
    dims = validate(cfg, dist.get_world_size())
    trainer = Trainer(cfg, dims, build_mesh(dims), torch.device("cpu"))
    injected(*where)(trainer)
    trainer.fit(Outputs(metrics=metrics))
    return trainer.start_step


def test_fp16_resumes_on_another_layout_with_its_scale(tmp_path):
    """6 steps on dp2 ZeRO-1, against 3 steps there (an overflow in step 1) and 3 more resumed
    at dp2 x tp2 ZeRO-3: the scale, its growth count (the scale doubles in step 3, after steps 2
    and 3), the skipped steps and the learning rate (held back by the skipped step) continue as if
    uninterrupted, read from the metrics each run writes. Losses as the matrix allows."""
    a, b = ["parallel.zero=1"], ["parallel.tp=2", "parallel.zero=3"]
    where = ("layers.0.attention.wo", {"dp": 1})
    run_world(_fit_fp16, 2, a, str(tmp_path / "straight"), str(tmp_path / "straight.jsonl"),
              where, timeout=240)
    run_world(_fit_fp16, 2, [*a, "train.stop_after=3"], str(tmp_path / "run"),
              str(tmp_path / "run.jsonl"), where, timeout=240)
    starts = run_world(_fit_fp16, 4, b, str(tmp_path / "run"), str(tmp_path / "run.jsonl"), where,
                       timeout=240)
    assert starts == [3] * 4
    want, got = (_records(tmp_path / f"{name}.jsonl") for name in ("straight", "run"))
    assert [r["step"] for r in got] == list(range(6))
    for key in ("loss_scale", "skipped_steps", "lr"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert [r["loss_scale"] for r in want] == [2.0**14, 2.0**13, 2.0**13, 2.0**14, 2.0**14,
                                               2.0**15]
    assert [r["skipped_steps"] for r in want] == [0, 1, 1, 1, 1, 1]
    assert want[2]["lr"] == want[1]["lr"]  # the skipped step left the schedule where it was
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got]),
                               torch.tensor([r["loss"] for r in want]), rtol=1e-3, atol=0)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


class _NaN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * float("nan")

    @staticmethod
    def backward(ctx, grad):
        return grad


def _nan_loss_at(step: int, policy: str):
    cfg = tiny_config(*BASE, "parallel.pp=2", f"train.nan_policy={policy}")
    dims = validate(cfg, dist.get_world_size())
    trainer = Trainer(cfg, dims, build_mesh(dims), torch.device("cpu"))
    now = [0]

    def hook(_, __, output):
        if now[0] == step:
            return _NaN.apply(output)
    for chunk in trainer.model.values():  # the final norm, on the last stage
        if isinstance(getattr(chunk, "norm", None), torch.nn.Module):
            chunk.norm.register_forward_hook(hook)
    out = []
    for i in range(3):
        now[0] = i
        try:
            result = trainer.train_step(i)
        except NonFiniteGradient as e:
            return out, str(e)
        out.append(result["skipped"])
    return out, None


def test_a_non_finite_loss_is_nan_policys_not_the_scalers():
    """Under fp16 a non-finite gradient norm with a finite loss is an overflow (the rows above);
    with the loss itself NaN (the forward's fault, which no scale cures) train.nan_policy
    decides, as under fp32: 'stop' ends the run at that step, 'skip' drops it (2 ranks, the NaN
    on the last stage of a pipeline: every rank decides alike)."""
    for steps, error in run_world(_nan_loss_at, 2, 1, "stop", timeout=120):
        assert steps == [False] and error.startswith("step 1: the gradient norm is nan")
    for steps, error in run_world(_nan_loss_at, 2, 1, "skip", timeout=120):
        assert steps == [False, True, False] and error is None


def test_compressions_error_feedback_survives_an_overflow():
    """fp16 with top-k's error feedback at dp2, the overflow injected on rank 1 in step 1: the
    step is skipped with the scale halved as in the rows above, the error buffers stay finite
    (an overflowed buffer's error restarts from zero), and the steps after it train."""
    cfg = tiny_config(*BASE, "parallel.compression=topk", "parallel.compression_ratio=0.1")

    def errors(trainer):
        return lambda: [bool(e.isfinite().all())
                        for e in trainer.parallelized.engine.compression.method.error.values()]

    def probe(trainer):
        scales, errs = injected("layers.2.feed_forward.w2", {"dp": 1})(trainer), errors(trainer)
        return lambda: {**scales(), "finite": errs()}

    for r in run_world(run_steps, 2, cfg, STEPS, probe, timeout=120):
        assert r["probe"]["scales"] == [2.0**14, 2.0**13, 2.0**13, 2.0**14]
        assert r["probe"]["finite"] and all(r["probe"]["finite"])
        assert all(math.isfinite(x) for x in r["losses"]) and r["losses"][3] < r["losses"][0]
