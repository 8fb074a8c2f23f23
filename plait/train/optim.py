"""AdamW and the learning-rate schedule: linear warm-up, then cosine decay to a floor.

With `train.lr_scaling = "linear"` the peak LR is scaled by global_batch / base_batch (the linear
scaling rule of Goyal et al. 2017, "Accurate, Large Minibatch SGD"), which is why it pairs with a
warm-up.
"""

from __future__ import annotations

import math

import torch

from plait.config import TrainConfig


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
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=(cfg.beta1, cfg.beta2))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
