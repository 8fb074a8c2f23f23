"""Bytes of model state a rank holds: parameters, gradients, optimizer state (ZeRO's accounting)."""

from __future__ import annotations

from dataclasses import dataclass

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


class Slice:
    """This rank's slice of a flat parameter group, and what the optimizer steps for it: the slice
    itself, or a master copy: fp32 under mixed precision (the slice being bf16), in host memory
    under optimizer offload (ZeRO-Offload, Ren et al. 2021: the update runs on the CPU)."""

    def __init__(self, shard: torch.Tensor, master_dtype: torch.dtype,
                 master_device: torch.device | None = None):
        self.shard = shard
        device = master_device or shard.device
        if shard.dtype == master_dtype and shard.device == device:
            self.master = shard
        else:
            self.master = shard.detach().to(device=device, dtype=master_dtype, copy=True)
            if device.type == "cpu" and shard.device.type == "cuda":
                self.master = self.master.pin_memory()  # fast, asynchronous copies each step

    def set_grad(self, grad: torch.Tensor) -> None:
        """The averaged gradient of the slice, in the master's dtype and on its device."""
        m = self.master
        same = grad.dtype == m.dtype and grad.device == m.device
        m.grad = grad if same else grad.to(device=m.device, dtype=m.dtype)

    def after_step(self) -> None:
        """Round the updated master into the slice; drop a gradient copy made for the master."""
        if self.master is not self.shard:
            self.shard.copy_(self.master, non_blocking=True)
            self.master.grad = None

    @property
    def master_bytes(self) -> int:
        """Bytes of a separate master copy (optimizer state in ZeRO's accounting)."""
        return 0 if self.master is self.shard else nbytes([self.master])


@dataclass
class Piece:
    """Part of parameter `name` held in `tensor` (what the optimizer steps: the parameter itself,
    or a ZeRO slice): elements [lo, lo + numel) of tensor.view(-1) are elements [start, start +
    numel) of this rank's (tensor-parallel) parameter, flattened."""

    name: str
    tensor: torch.Tensor
    lo: int
    start: int
    numel: int
