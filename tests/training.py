"""Shared test helpers: small configurations and one training run on the current world, the
same function for the single-process reference and for every parallel composition."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from plait.comm import LEDGER
from plait.config.schema import load_config
from plait.mesh import build_mesh
from plait.predict import cost
from plait.train.checks import validate
from plait.train.trainer import Trainer

STEPS = 5


def tiny_config(*overrides):
    return load_config(None, [
        "model.preset='tiny'", f"train.steps={STEPS}", "train.warmup_steps=2",
        "train.global_batch=8", "train.peak_tflops=1.0", "train.eval_batches=1",
        "data.seq_len=32", "data.max_bytes=200000", *overrides,
    ])


def assert_params_close(got: torch.Tensor, want: torch.Tensor, name: str, atol: float = 1e-5,
                        lr: float = 3e-3, steps: int = STEPS) -> None:
    """A parameter after `steps` AdamW steps of peak `lr` equals its reference, as far as float32
    summation order lets it, on any x86 CPU.

    Why not every element within `atol`: Adam divides each element's momentum by the root of its
    second moment, so an element whose gradient is at the noise level of summation order (a sum
    that nearly cancels) takes a step whose size and sign the noise decides, up to ~lr, and the
    noise is the CPU kernels' (measured: one embedding element of 8,192 off by 6e-5 at ep2 x tp2
    on an AMD EPYC after 4 steps, the rest within 5e-6; on an AVX-512 Xeon, whose kernels block
    a split matmul otherwise than the whole one, 5 of 1,024 elements of a tp2 key projection
    beyond 1e-5 after 5 steps, and under its AVX2 kernels 16 of 512 at tp4, the largest 3.2e-5,
    all with gradients below the tensor's median: a key projection's gradients are small). A
    real error (a gradient missed, doubled, scaled or summed on the wrong group; an update
    skipped or applied to the wrong shard) moves most of a tensor's elements by ~lr = 3e-3. So,
    per tensor: at most 1 element in 10 beyond `atol` and 1 in 1,000 (at least one) beyond
    10 atol, none beyond 2 lr per step (two AdamW trajectories cannot drift further), and the
    mean difference below atol / 10, which an error in even one row of 256 (lr per step on
    1/256 of the elements) exceeds several times over."""
    diff = (got.float() - want.float()).abs()
    for bound, share in ((atol, 10), (10 * atol, 1000)):
        beyond = int((diff > bound).sum())
        assert beyond <= max(1, diff.numel() // share), \
            f"{name}: {beyond} of {diff.numel()} elements differ by more than {bound:g} " \
            f"(largest {diff.max().item():.3g})"
    assert diff.max().item() <= 2 * lr * steps, f"{name}: off by {diff.max().item():.3g}"
    assert diff.mean().item() <= atol / 10, \
        f"{name}: mean difference {diff.mean().item():.3g} > {atol / 10:g}"


def unclipped(cfg):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_clip=0.0))


def held_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's parameters by single-device name (ZeRO-3: gathered whole)."""
    engine = trainer.parallelized.engine
    if hasattr(engine, "full_state_dict"):
        return engine.full_state_dict()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def held_masters(trainer: Trainer) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """What this rank's optimizer steps, by single-device name: (first element in the (tensor-
    parallel) parameter flattened, the elements), in full precision (ZeRO's fp32 masters of bf16
    parameters; the parameters themselves otherwise)."""
    held: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for piece in trainer.parallelized.engine.held_pieces():
        values = piece.tensor.view(-1)[piece.lo : piece.lo + piece.numel]
        held.setdefault(piece.name, []).append((piece.start, values.detach().float().clone()))
    return held


def train_here(cfg, steps: int | None = None):
    """Train on the current world: losses, validation loss, parameters after the run, the ledger
    of one more step, gradient bytes, and the averaged gradients of step 0 (those a parameter
    holds as .grad; ZeRO-2/3 hold slices instead)."""
    dims = validate(cfg, dist.get_world_size())
    mesh = build_mesh(dims)
    # Unclipped: clipping rescales any gradient to the same norm and would hide a wrong scale.
    first = Trainer(unclipped(cfg), dims, mesh, torch.device("cpu"))
    first.train_step(0)
    grads = {n: p.grad.clone() for n, p in first.model.named_parameters() if p.grad is not None}
    trainer = Trainer(cfg, dims, mesh, torch.device("cpu"))
    summary = trainer.fit()
    params = held_params(trainer)
    LEDGER.reset()
    trainer.train_step(cfg.train.steps)  # one more step, to read its communication alone
    grad_bytes = sum(p.numel() * 4 for p in trainer.model.parameters())
    ledger = (LEDGER.bytes, dict(LEDGER.calls), len(trainer.parallelized.engine.buckets),
              dist.get_rank())
    return summary.losses, summary.val_loss, params, ledger, grad_bytes, grads


def run_steps(cfg, steps: int = 4, probe=None):
    """The composition matrix's run: `steps` optimizer steps through the trainer's one step path;
    per rank, what the matrix compares and accounts. The last step's ledger is read alone.
    `probe(trainer)`, if given, is installed before the first step and returns a function whose
    result after the last step is returned as "probe"."""
    dims = validate(cfg, dist.get_world_size())
    trainer = Trainer(cfg, dims, build_mesh(dims), torch.device("cpu"))
    probed = probe(trainer) if probe is not None else None
    losses = []
    for step in range(steps):
        LEDGER.reset()
        result = trainer.train_step(step)
        ledger = (dict(LEDGER.calls), dict(LEDGER.bytes_by_op))
        losses.append(trainer._global_mean(result["loss"]))
    record = trainer.parallelized.record
    traffic = cost.step_traffic(cfg, dims, record, cost.chunk_layouts(trainer.model))
    return {
        "traffic": (dict(traffic.calls), traffic.bytes),
        "state_formula": cost.state_bytes(cfg, dims, record),
        "rank": dist.get_rank(),
        "coords": dims.coords(dist.get_rank()),
        "losses": losses,
        "params": held_params(trainer),
        "masters": held_masters(trainer),
        "placements": {n: (p.shape, dict(p.shards), set(p.replicated))
                       for n, p in record.params.items()},
        "ledger": ledger,
        "state": trainer.parallelized.state_bytes(trainer.optimizer),
        "activation_bytes": result["activation_bytes"],
        "activations_left": trainer.activations.bytes,  # kept past the step: a leak
        "probe": probed() if probed is not None else None,
    }


class _Overflow(torch.autograd.Function):
    """Forward: x. Backward: x's gradient with its first element infinite (an fp16 overflow)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad


def overflow_at(module: torch.nn.Module, step: int, now: list[int]) -> None:
    """Make `module`'s output gradient overflow in the backward of step `step` (`now[0]` is the
    step running)."""
    def hook(_, __, output):
        if now[0] == step and torch.is_grad_enabled():
            return _Overflow.apply(output)
    module.register_forward_hook(hook)


def grad_scaler_reference(cfg, steps: int = 4, inject: tuple[str, int] | None = None,
                          half_params: bool = False) -> dict:
    """One process training the whole model with torch's own fp16 recipe: autocast and
    `torch.amp.GradScaler` with the run's settings (its rule is hysteresis 1), unscale, clip,
    `scaler.step`, `scaler.update`; a skipped step leaves the LR schedule where it was.
    `half_params`: fp16 parameters with fp32 masters that the optimizer steps (as ZeRO holds
    them; Micikevicius et al. 2018). `inject` = (module name, step): that module's output
    gradient overflows in that step. Returns losses, the scale after each step, the global norm
    of the unscaled gradient before clipping, the skipped steps, and the parameters."""
    from plait.data.batches import TokenData
    from plait.model.moe import MoEFeedForward
    from plait.optim.build import build_optimizer, lr_at, set_lr
    from plait.parallel import cross_entropy
    from plait.train.trainer import build_configured_model

    train = cfg.train
    model = build_configured_model(cfg)
    params = dict(model.named_parameters())
    if half_params:
        params = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
        model.half()
    optimizer = build_optimizer([p for p in params.values() if p.dim() >= 2],
                                [p for p in params.values() if p.dim() < 2], train)
    scaler = torch.amp.GradScaler("cpu", init_scale=train.loss_scale_init,
                                  growth_interval=train.loss_scale_growth_interval)
    now = [0]
    if inject is not None:
        overflow_at(model.get_submodule(inject[0]), inject[1], now)
    data = TokenData(cfg.data, train.seed)
    out = {"losses": [], "scales": [], "norms": [], "skipped": 0}
    for step in range(steps):
        now[0] = step
        set_lr(optimizer, lr_at(step - out["skipped"], train))
        for m in model.modules():  # the auxiliary losses' gradients carry the scale too
            if isinstance(m, MoEFeedForward):
                m.loss_scale = scaler.get_scale()
        inputs, targets = data.batch(step, train.global_batch)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = cross_entropy(model(inputs), targets)
        scaler.scale(loss).backward()
        if half_params:
            for n, p in model.named_parameters():
                params[n].grad, p.grad = p.grad.float(), None
        scaler.unscale_(optimizer)
        out["skipped"] += not all(torch.isfinite(p.grad).all() for p in params.values())
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), train.grad_clip or math.inf)
        out["norms"].append(norm.item())
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if half_params:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(params[n])
        out["losses"].append(loss.item())
        out["scales"].append(scaler.get_scale())
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["masters"] = {n: [(0, p.detach().float().view(-1).clone())] for n, p in params.items()}
    return out
