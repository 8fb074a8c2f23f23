"""Bytes of model state a rank holds: parameters, gradients, optimizer state (ZeRO's accounting)."""

from __future__ import annotations

import torch
from torch import nn


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Per-element state (Adam's two moments); the 0-dim step counters are bookkeeping, not model
    state in the sense of ZeRO's 2 + 2 + K bytes per parameter."""
    return nbytes(t for state in optimizer.state.values() for t in state.values()
                  if torch.is_tensor(t) and t.dim() > 0)


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """For a model whose parameters and gradients are its own (no flat buckets)."""
    params = list(model.parameters())
    return {
        "params": nbytes(params),
        "grads": nbytes(p.grad for p in params),
        "optimizer": optimizer_state_bytes(optimizer),
    }
