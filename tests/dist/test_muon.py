"""Muon (`train.optimizer = "muon"`, `plait/optim/muon.py`) under every layout equals one
process running `torch.optim.Muon` for the blocks' matrices and `torch.optim.AdamW` for the rest.

Three proofs, each for what it can prove:
- The exchange, exactly: every layout is handed the same gradients as one process (injected into
  what each rank steps, so no summation order differs), and after two steps every element each
  rank holds has the very bits torch's two optimizers give in one process. A matrix
  orthogonalized in pieces, twice, by a wrong owner, or returned to the wrong rank fails this.
- The trainer in one process, exactly: plait's step (its global norm, unclipped) with Muon over
  plait's Llama gives the bits of a plain loop of torch's two optimizers on the same batches.
- The composition rows (`test_compositions.py`'s `MUON_ROWS`) train with Muon end to end,
  accounted exactly (collectives, state) and compared with one process with a tolerance of their
  own: see there.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist
from harness import run_world
from training import tiny_config, unclipped

from plait.train.checks import validate
from plait.mesh import build_mesh
from plait.parallel.vocab_parallel import HeadCrossEntropy
from plait.data.batches import TokenData
from plait.optim.build import lr_at, set_lr
from plait.train.trainer import Trainer, build_configured_model

BASE = ["model.n_layers=2", "train.warmup_steps=2", "train.steps=4", "train.optimizer='muon'"]
STEPS = 2


def is_matrix(name: str, p: torch.Tensor) -> bool:
    """Muon's split as the test states it: the blocks' 2-D weights."""
    return name.startswith("layers.") and p.dim() == 2


def gradients(shapes: dict[str, tuple], step: int) -> dict[str, torch.Tensor]:
    """Each parameter's from its name and the step alone (a pipeline stage knows its own)."""
    return {n: torch.randn(s, generator=torch.Generator().manual_seed(zlib.crc32(n.encode())
                                                                        + step))
            for n, s in shapes.items()}


def torch_optimizers(model: torch.nn.Module, cfg):
    train = cfg.train
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_matrix(n, p)], lr=train.lr,
                            weight_decay=train.weight_decay, momentum=train.muon_momentum,
                            nesterov=train.muon_nesterov, ns_steps=train.muon_ns_steps,
                            adjust_lr_fn=train.muon_adjust_lr)
    rest = [(n, p) for n, p in named if not is_matrix(n, p)]
    adamw = torch.optim.AdamW([{"params": [p for _, p in rest if p.dim() >= 2],
                                "weight_decay": train.weight_decay},
                               {"params": [p for _, p in rest if p.dim() < 2],
                                "weight_decay": 0.0}],
                              lr=train.lr, betas=(train.beta1, train.beta2))
    return muon, adamw


def _injected(cfg, everywhere: bool = False):
    """Per rank: each held piece of each parameter after STEPS optimizer steps with the injected
    gradients, and where its tp shard lies. `everywhere`: with `plait bench step`'s alternative
    exchange (every rank orthogonalizes every matrix)."""
    dims = validate(cfg, dist.get_world_size())
    trainer = Trainer(cfg, dims, build_mesh(dims), torch.device("cpu"))
    record, engine = trainer.parallelized.record, trainer.parallelized.engine
    if everywhere:
        from plait.bench.muon import EverywhereExchange

        trainer.optimizer.exchange = EverywhereExchange(engine, record,
                                                        trainer.parallelized.axes["tp"])
    pieces = engine.held_pieces()
    for step in range(STEPS):
        grads = gradients({n: p.shape for n, p in record.params.items()}, step)
        for piece in pieces:
            place = record.params[piece.name]
            local = grads[piece.name]
            for d, (o, n) in enumerate(zip(place.origin, place.local_shape, strict=True)):
                local = local.narrow(d, o, n)
            if piece.tensor.grad is None:
                piece.tensor.grad = torch.zeros_like(piece.tensor)
            piece.tensor.grad.view(-1)[piece.lo : piece.lo + piece.numel] = \
                local.reshape(-1)[piece.start : piece.start + piece.numel]
        set_lr(trainer.optimizer, lr_at(step, cfg.train))
        trainer.optimizer.step()
    return [(p.name, record.params[p.name].origin, record.params[p.name].local_shape, p.start,
             p.tensor.detach().view(-1)[p.lo : p.lo + p.numel].clone()) for p in pieces]


LAYOUTS = [
    ("ddp-dp2", 2, []),
    ("zero1-dp4", 4, ["parallel.zero=1"]),
    ("zero3-dp2-tp2", 4, ["parallel.zero=3", "parallel.tp=2"]),
    ("hsdp-zero2-dp4-shard2", 4, ["parallel.zero=2", "parallel.dp_shard=2"]),
    ("pp2-tp2-sp", 4, ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("moe-ep2-tp2-zero1", 4, ["model.preset='tiny-moe'", "parallel.ep=2", "parallel.tp=2",
                              "parallel.zero=1"]),
]


EVERYWHERE = [("everywhere-" + name, ranks, overrides, True)
              for name, ranks, overrides in LAYOUTS if name in ("ddp-dp2", "zero3-dp2-tp2")]


@pytest.mark.parametrize("ranks,overrides,everywhere",
                         [(*r[1:], False) for r in LAYOUTS] + [r[1:] for r in EVERYWHERE],
                         ids=[r[0] for r in LAYOUTS] + [r[0] for r in EVERYWHERE])
def test_every_layout_steps_the_bits_of_torch_muon(ranks, overrides, everywhere):
    cfg = tiny_config(*BASE, *overrides)
    model = build_configured_model(cfg)
    muon, adamw = torch_optimizers(model, cfg)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    assert any(is_matrix(n, p) for n, p in model.named_parameters())
    for step in range(STEPS):
        grads = gradients(shapes, step)
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        for optimizer in (muon, adamw):
            set_lr(optimizer, lr_at(step, cfg.train))
            optimizer.step()
    want = dict(model.named_parameters())
    seen = set()
    for held in run_world(_injected, ranks, cfg, everywhere, timeout=240):
        for name, origin, local_shape, start, values in held:
            full = want[name].detach()
            for d, (o, n) in enumerate(zip(origin, local_shape, strict=True)):
                full = full.narrow(d, o, n)
            expected = full.reshape(-1)[start : start + len(values)]
            assert torch.equal(values, expected), \
                f"{name}: off by {(values - expected).abs().max().item():.3g}"
            seen.add(name)
    assert seen == set(want)


def _trained(cfg):
    dims = validate(cfg, dist.get_world_size())
    trainer = Trainer(cfg, dims, build_mesh(dims), torch.device("cpu"))
    losses = [trainer.train_step(step)["loss"] for step in range(cfg.train.steps)]
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _fused_loss(model, inputs, targets):
    """The trainer's loss: plait's cross-entropy from the head's input (`HeadCrossEntropy`:
    fused with the head where the logits would be large)."""
    seen = []
    handle = model.output.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    model(inputs)
    handle.remove()
    return HeadCrossEntropy().fused(seen[0], model.output, targets)


def test_one_process_trains_as_torch_muon_and_adamw():
    cfg = unclipped(tiny_config(*BASE))
    losses, params = run_world(_trained, 1, cfg)[0]
    model = build_configured_model(cfg)
    muon, adamw = torch_optimizers(model, cfg)
    data = TokenData(cfg.data, cfg.train.seed)
    want = []
    for step in range(cfg.train.steps):
        model.zero_grad(set_to_none=True)
        inputs, targets = data.batch(step, cfg.train.global_batch)[:2]
        loss = _fused_loss(model, inputs, targets)
        loss.backward()
        for optimizer in (muon, adamw):
            set_lr(optimizer, lr_at(step, cfg.train))
            optimizer.step()
        want.append(loss.item())
    assert losses == want
    for name, p in model.named_parameters():
        assert torch.equal(params[name], p.detach()), name


@pytest.mark.parametrize("ranks,overrides", [
    (4, ["parallel.zero=3", "parallel.tp=2"]),
    (4, ["parallel.pp=2"]),
    (4, ["model.preset='tiny-moe'", "parallel.ep=2", "parallel.tp=2", "parallel.zero=1"]),
], ids=["zero3-dp2-tp2", "pp2-dp2", "moe-ep2-tp2-zero1"])
def test_each_matrix_has_one_owner_and_the_work_is_shared(ranks, overrides):
    """From `--dry-run`'s account of each rank (no process group): the Newton-Schulz FLOPs the
    ranks own add up to every matrix orthogonalized once, and no rank owns more than the largest
    matrix's above an even share."""
    from plait.optim.muon_routes import newton_schulz_flops
    from plait.train.dry_run import describe_rank

    cfg = tiny_config(*BASE, *overrides)
    dims = validate(cfg, ranks)
    model = build_configured_model(cfg)
    each = [newton_schulz_flops(tuple(p.shape), 5) for n, p in model.named_parameters()
            if is_matrix(n, p)]
    owned = [describe_rank(cfg, dims, r)["newton_schulz_flops"] for r in range(ranks)]
    assert sum(owned) == sum(each)
    assert max(owned) <= sum(each) / ranks + max(each)
