"""SwiGLU feed-forward: the dense block's, and each expert of a mixture of experts.

The down projection takes its input, the gate silu(w1 x) * w3 x, from `GatedDown`, which keeps
w1 x and w3 x for backward and makes the gate again there (an elementwise product, no matmul):
autograd alone would keep silu(w1 x) and the gate as well, two more tensors of the hidden size,
the largest a block keeps (Korthikanti et al. 2022 recompute such cheap elementwise work under
selective recomputation; here it is never kept, in every checkpointing mode).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from plait.model.args import ModelArgs


class GatedDown(torch.autograd.Function):
    """w2(silu(a) * b) for a bias-free `weight`, keeping a, b and the weight (a parameter: model
    state) for backward, not the gate; its matmul in `dtype` (autocast's, or the weight's). The
    backward runs autograd's own operations (the gate's product, the matmul's two products,
    silu's backward) in the same order, so the gradients are those of the unfused module."""

    @staticmethod
    def forward(ctx, a, b, weight, dtype):
        gate = F.silu(a) * b
        ctx.save_for_backward(a, b, weight)
        ctx.dtype = dtype
        return F.linear(gate.to(dtype), weight.to(dtype))

    @staticmethod
    def backward(ctx, grad_out):
        a, b, weight = ctx.saved_tensors
        silu = F.silu(a)
        gate = (silu * b).to(ctx.dtype)
        w = weight.to(ctx.dtype)
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_gate = g.mm(w).view(gate.shape).to(a.dtype)
        grad_w = g.t().mm(gate.reshape(-1, gate.shape[-1])).to(weight.dtype)
        grad_a = torch.ops.aten.silu_backward(grad_gate * b, a)
        return grad_a, grad_gate * silu, grad_w, None


def matmul_dtype(device: str, weight: torch.Tensor) -> torch.dtype:
    """The dtype a hand-written linear's matmul runs in on `device`: autocast's where it is on
    (as F.linear's would), else the weight's."""
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
        else weight.dtype


def _gated_down(a: torch.Tensor, *, b: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    device = a.device.type
    dtype = matmul_dtype(device, linear.weight)
    with torch.autocast(device, enabled=False):
        return GatedDown.apply(a, b, linear.weight, dtype)


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.w1(x), self.w3(x)
        if isinstance(self.w2.weight, DTensor) or torch.compiler.is_compiling():
            # The plain composition: torch's tensor parallelism (bench step's peer) converts w2's
            # input alone to a DTensor; under torch.compile the compiler chooses what to keep
            # (and cannot trace a forward swapped on the module)
            return self.w2(F.silu(a) * b)
        # w2 called as a module (its hooks run: a ZeRO-3 unit of its own gathers its weight),
        # its forward `GatedDown` for this call.
        self.w2.forward = functools.partial(_gated_down, b=b, linear=self.w2)
        try:
            return self.w2(a)
        finally:
            del self.w2.forward
