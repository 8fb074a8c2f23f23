"""Sequence parallelism's column-parallel linears keep the input's shard, not the gathered input
(Korthikanti et al. 2022, section 4.2.2).

Under sequence parallelism a block half's input arrives as this rank's shard of the sequence and
is all-gathered on the way in (`tensor_parallel._wrap_half`); the half's column-parallel linears
(q, k, v; w1, w3) read the whole sequence. Autograd would keep that gathered input for their
weight gradients (under autocast a bf16 cast of it per linear): T times the shard, the largest
thing a block keeps at tp = 8. Here the linears keep the shard instead and gather it again in
backward, once for all the linears of the half (the first linear's backward gathers, the last
lets it go): one more all-gather per half and micro-batch, of the bytes the forward's moved.

The half's pre-hook marks the gathered tensor (`mark`) with the shard it came from; a linear
whose input is so marked runs `ShardKeepingLinear`, any other input (a mixture of experts' routed
rows, a model that transforms the input first) the plain linear.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from plait.comm.autograd import _gather_seq
from plait.model.feed_forward import matmul_dtype

_MARK = "_plait_sequence_shard"


class Regathered:
    """A half's input, gathered again while the half's backward needs it: by the first of the
    `users` linears' backward passes, let go after the last (and so again for a second pass, as
    a split backward's weight pass makes). The shard itself is each linear's saved tensor (so
    activation checkpointing drops it and the activation count sees it)."""

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.users = self._pending = 0
        self._whole: torch.Tensor | None = None

    def take(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The gathered input in `dtype` (the linears' matmul dtype, cast once for them all)."""
        if self._whole is None:
            self._whole = _gather_seq(shard, self.group).to(dtype)
        whole = self._whole
        self._pending -= 1
        if self._pending <= 0:
            self._whole, self._pending = None, self.users
        return whole


def mark(whole: torch.Tensor, shard: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Note on the gathered `whole` the `shard` it was gathered from."""
    setattr(whole, _MARK, (shard, Regathered(group)))
    return whole


class ShardKeepingLinear(torch.autograd.Function):
    """x W^T (+ b) for an x that is a sequence-parallel gather of `shard`: keeps the shard and
    the weight (a parameter: model state) for backward, not x; its matmul in `dtype` (autocast's,
    or the weight's). The backward runs the products F.linear's backward runs, so the gradients
    are the plain linear's."""

    @staticmethod
    def forward(ctx, x, shard, weight, regathered, dtype, bias=None):
        regathered.users += 1
        regathered._pending += 1
        ctx.save_for_backward(shard, weight)
        ctx.regathered, ctx.dtype, ctx.x_dtype = regathered, dtype, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad_out):
        shard, weight = ctx.saved_tensors
        x = ctx.regathered.take(shard, ctx.dtype)
        w = weight.to(ctx.dtype)
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = g.mm(w).view(*grad_out.shape[:-1], w.shape[1]).to(ctx.x_dtype)
        grad_w = g.t().mm(x.reshape(-1, x.shape[-1])).to(weight.dtype)
        grad_b = None if ctx.bias_dtype is None else g.sum(0).to(ctx.bias_dtype)
        return grad_x, None, grad_w, None, None, grad_b


def _forward(x: torch.Tensor, *, linear: nn.Linear) -> torch.Tensor:
    marked = getattr(x, _MARK, None)
    if marked is None:
        return F.linear(x, linear.weight, linear.bias)
    shard, regathered = marked
    device = x.device.type
    dtype = matmul_dtype(device, linear.weight)
    with torch.autocast(device, enabled=False):
        return ShardKeepingLinear.apply(x, shard.detach(), linear.weight, regathered, dtype,
                                        linear.bias)


def keep_shard(linear: nn.Module) -> None:
    """Make a column-parallel `linear` keep its input's shard where its input is a marked gather
    (its module hooks still run: it is still called as a module)."""
    if type(linear) is nn.Linear:
        # Eager under `train.compile` (plait/parallel/compile.py): it reads the gather's mark.
        linear.forward = torch.compiler.disable(functools.partial(_forward, linear=linear))
