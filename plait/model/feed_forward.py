"""SwiGLU feed-forward: the dense block's, and each expert of a mixture of experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.model.args import ModelArgs


class SwiGLUGate(nn.Module):
    """silu(a) * b: the gate of SwiGLU, a module so that it can be recomputed on its own."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.silu(a) * b


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.gate = SwiGLUGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.gate(self.w1(x), self.w3(x)))
