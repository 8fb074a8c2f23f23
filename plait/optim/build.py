"""The optimizers (`train.optimizer`: AdamW; Muon for the blocks' matrices with AdamW for the
rest, `plait/optim/muon.py`; SGD with momentum) and the learning-rate schedule: linear warm-up,
then cosine decay to a floor.

With `train.lr_scaling = "linear"` the peak LR is scaled by global_batch / base_batch (the linear
scaling rule of Goyal et al. 2017, "Accurate, Large Minibatch SGD"), which is why it pairs with a
warm-up.
"""

from __future__ import annotations

import math

import torch

from plait.config.schema import TrainConfig
from plait.optim.muon import MatrixExchange, MuonAdamW


def peak_lr(cfg: TrainConfig) -> float:
    if cfg.lr_scaling == "linear":
        return cfg.lr * cfg.global_batch / cfg.base_batch
    return cfg.lr


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step `step` (0-based): warm-up over `warmup_steps` reaching the peak at the
    last warm-up step, then a half cosine from the peak to peak * min_lr_ratio at the last step."""
    peak = peak_lr(cfg)
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = peak * cfg.min_lr_ratio
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def build_optimizer(
    decay: list[torch.Tensor], no_decay: list[torch.Tensor], cfg: TrainConfig
) -> torch.optim.AdamW:
    """AdamW; weight decay on `decay` (matrices and embeddings), never on `no_decay` (norm
    gains)."""
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # On a GPU torch's fused kernel (one launch for every tensor, the update in registers);
    # elsewhere its default (foreach).
    params = decay + no_decay
    fused = True if params and all(p.is_cuda for p in params) else None
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=(cfg.beta1, cfg.beta2),
                             fused=fused)


def build_for(parallelized, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer `train.optimizer` names over what `parallelized` (a
    `plait.parallel.Parallelized` built with `whole` for Muon) gives it to step."""
    decay, no_decay = parallelized.optimizer_groups()
    if cfg.optimizer == "sgd":
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.SGD(groups, lr=lr_at(0, cfg), momentum=cfg.sgd_momentum)
    if cfg.optimizer == "muon":
        engine = parallelized.engine
        exchange = MatrixExchange(engine, parallelized.record, parallelized.axes["tp"])
        return MuonAdamW(engine.matrix_tensors(), decay, no_decay, exchange, lr=lr_at(0, cfg),
                    weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2),
                    momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                    ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr,
                    lr_ratio=cfg.muon_lr_ratio)
    return build_optimizer(decay, no_decay, cfg)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's lr into every group (times a group's "lr_ratio": Muon's matrices)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)
