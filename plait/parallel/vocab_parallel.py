"""Vocabulary parallelism: the embedding table and the output head split by vocabulary rows over
the `tp` axis, and a cross-entropy that never gathers the full logits (Megatron-LM, Shoeybi et al.
2019, section 3: "parallelize the input embedding ... fuse the output with the cross entropy").

Rank r holds vocabulary rows [r V / T, (r + 1) V / T).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup, ReduceOp

from plait.comm import all_reduce
from plait.comm.autograd import reduce_from_tp, reduce_scatter_to_sp
from plait.mesh import Axis
from plait.model.feed_forward import matmul_dtype
from plait.model.hf import softcapped
from plait.parallel.embedding_grad import embedding


def vocab_range(vocab_size: int, group: ProcessGroup) -> tuple[int, int]:
    per = vocab_size // dist.get_world_size(group)
    start = dist.get_rank(group) * per
    return start, start + per


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the tokens in its rows (zeros for the others); the partial embeddings are
    summed across `tp` (all-reduce, or reduce-scatter to sequence shards under sequence
    parallelism). An embedding that scales what it looks up (Gemma's by sqrt(hidden): a buffer
    `embed_scale`) is scaled so after the sum."""

    def __init__(self, full: nn.Embedding, tp: Axis, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = tp.group, sequence_parallel
        per = full.num_embeddings // tp.size
        self.start, self.end = tp.rank * per, (tp.rank + 1) * per
        self.weight = nn.Parameter(full.weight.detach()[self.start : self.end].clone())
        scale = getattr(full, "embed_scale", None)
        self.register_buffer("embed_scale", scale, persistent=False)
        # Under sequence parallelism its output is this rank's shard of the sequence (which, of
        # how many): what a model adding learned positions to it adds (GPT-2's, `HFCausalLM`).
        self.sequence_shard = (tp.rank, tp.size) if sequence_parallel else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        partial = embedding(local, self.weight).masked_fill(outside[..., None], 0.0)  # (b, s, h)
        if self.sequence_parallel:
            whole = reduce_scatter_to_sp(partial, self.group)  # (b, s / T, h)
        else:
            whole = reduce_from_tp(partial, self.group)
        return whole if self.embed_scale is None else whole * self.embed_scale.to(whole.dtype)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss log(sum_v exp z_v) - z_target from vocabulary-sharded logits z.

    Forward: three all-reduces of one float per token (the max, for stability; the sum of
    exponentials; the target's logit, which lives on exactly one rank). Backward needs no
    communication: d loss / d z_v = softmax_v - [v = target], for this rank's v.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, start):
        # logits: (tokens, V / T) float32; targets: (tokens,)
        logits_max = logits.max(dim=-1).values
        all_reduce(logits_max, group, op=ReduceOp.MAX)
        shifted = logits - logits_max[:, None]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, group)
        mine = (targets >= start) & (targets < start + logits.shape[-1])
        local_target = (targets - start).masked_fill(~mine, 0)
        target_logit = shifted.gather(1, local_target[:, None]).squeeze(1) * mine
        all_reduce(target_logit, group)
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), local_target, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad[torch.arange(len(grad)), local_target] -= mine.to(grad.dtype)
        return grad * grad_loss[:, None], None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: ProcessGroup, vocab_size: int
) -> torch.Tensor:
    """Mean cross-entropy over the tokens of (b, s, V / T) logits and (b, s) targets."""
    start, _ = vocab_range(vocab_size, group)
    losses = VocabParallelCrossEntropy.apply(
        logits.flatten(0, 1).float(), targets.flatten(), group, start
    )
    return losses.mean()


# Logits made at a time by `linear_cross_entropy`, by the device's kind. A CPU: 2^24 (64 MiB in
# fp32), so a 128K vocabulary takes 130 tokens at a time and plait's 256-byte one 65,536. A GPU:
# 2^28 (1 GiB), 2,093 tokens of a 128K vocabulary: each run's weight gradient reads and writes
# the head's whole fp32 gradient (1 GiB at 128K x 2048), which at 130 tokens a run was half of a
# 1B model's step on an H200 (docs/benchmarks.md#on-a-gpu).
LOGIT_BLOCK = {"cpu": 2**24, "cuda": 2**28}


def logit_block(device: str) -> int:
    """Logits `linear_cross_entropy` makes at a time on a device of this kind ("cpu", "cuda")."""
    return LOGIT_BLOCK["cpu" if device == "cpu" else "cuda"]


def run_tokens(vocab: int, device: str, block: int = 0) -> int:
    """Tokens in one run of `linear_cross_entropy` over a (local) vocabulary of `vocab` rows:
    `block` logits at a time (0: the device's `logit_block`), at least one token."""
    return max(1, (block or logit_block(device)) // vocab)


def compute_device(cfg) -> str:
    """The kind of device a configuration's ranks compute on: train.device, "auto" resolved as
    the workers resolve it (a GPU when there is one)."""
    if cfg.train.device != "auto":
        return cfg.train.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_loss(x: torch.Tensor, w: torch.Tensor,
             t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A run's fp32 log-sum-exp and target logit, from its hidden states `x`, the head's weight
    `w` (both in the matmul's dtype) and its targets `t`."""
    z = (x @ w.T).float()
    return torch.logsumexp(z, dim=-1), z.gather(1, t[:, None]).squeeze(1)


def run_grad(x: torch.Tensor, w: torch.Tensor, lse: torch.Tensor, t: torch.Tensor,
             mine: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """A run's d loss / d z = (softmax - [v = target]) x the loss's gradient, in the matmul's
    dtype, from its hidden states, the head's weight, its log-sum-exp, (local) targets and which
    of them this rank's rows hold (`mine`): made in place over the fp32 copy of its logits
    (`backward_bytes` counts it)."""
    p = (x @ w.T).float().sub_(lse[:, None]).exp_()
    p[torch.arange(len(p), device=p.device), t.masked_fill(~mine, 0)] -= mine.to(p.dtype)
    return p.mul_(grad_loss[:, None]).to(x.dtype)


def _run_grad_pointwise(x, w, lse, t, mine, grad_loss):
    """`run_grad` with the gradient one pointwise expression of the product (the target's -1 a
    comparison with the column's index, not an indexed write), which a compiler makes one kernel
    after the matmul: the logits read once in the matmul's dtype, the gradient written once, no
    fp32 copy."""
    z = x @ w.T
    hit = torch.arange(z.shape[1], device=z.device) == t.masked_fill(~mine, -1)[:, None]
    p = (z.float() - lse[:, None]).exp() - hit.float()
    return (p * grad_loss[:, None]).to(x.dtype)


class RunKernels(NamedTuple):
    """The per-run arithmetic of `LinearCrossEntropy` around its matmuls."""

    loss: Callable  # run_loss's signature
    grad: Callable  # run_grad's


EAGER = RunKernels(run_loss, run_grad)


@functools.cache
def compiled_kernels(backend: str) -> RunKernels:
    """The per-run arithmetic through `torch.compile` (`train.compile`): on a GPU the eager
    runs' passes over their fp32 logits (the cast, logsumexp's, the in-place gradient's: ~3 in
    the forward and ~9 in the backward, each over a GiB of logits) are half of the head's time
    (docs/benchmarks.md, "plait bench gpu"); fused, a run's logits are read once each way. A
    kernel the compiler fails on runs eager (`apply_compile` sets dynamo's suppress_errors)."""
    return RunKernels(torch.compile(run_loss, backend=backend, dynamic=False),
                      torch.compile(_run_grad_pointwise, backend=backend, dynamic=False))


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits = hidden @ weight^T, never holding them whole: the
    tokens go through in runs of `per` (`logit_block` / V), each run's logits made, reduced to
    its log-sum-exp and target logit, and let go; backward makes them again, run by run (one
    more head matmul, as activation checkpointing of the head would), from the hidden states and
    the log-sum-exp alone. `dtype`: the matmuls' (autocast's, or the weight's); the softmax in
    fp32; `kernels`: the runs' arithmetic around the matmuls (eager, or compiled).
    Over `group` (a vocabulary-split head, rows [start, start + V / T)) each run's maximum,
    sum of exponentials and target logit are all-reduced, as `VocabParallelCrossEntropy`'s."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, dtype, per, group, start, kernels=EAGER):
        x, w = hidden.to(dtype), weight.to(dtype)
        lse = torch.empty(len(x), dtype=torch.float32, device=x.device)
        picked = torch.empty_like(lse)
        for lo in range(0, len(x), per):
            t = targets[lo : lo + per]
            if group is None:
                lse[lo : lo + per], picked[lo : lo + per] = kernels.loss(x[lo : lo + per], w, t)
                continue
            z = (x[lo : lo + per] @ w.T).float()
            top = z.max(dim=-1).values
            all_reduce(top, group, op=ReduceOp.MAX)
            total = (z - top[:, None]).exp().sum(dim=-1)
            all_reduce(total, group)
            mine = (t >= start) & (t < start + len(w))
            target = z.gather(1, (t - start).masked_fill(~mine, 0)[:, None]).squeeze(1) * mine
            all_reduce(target, group)
            lse[lo : lo + per], picked[lo : lo + per] = top + total.log(), target
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.dtype, ctx.per, ctx.start, ctx.split = dtype, per, start, group is not None
        ctx.kernels = kernels
        return lse - picked

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, lse = ctx.saved_tensors
        x, w = hidden.to(ctx.dtype), weight.to(ctx.dtype)
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        per = ctx.per
        for lo in range(0, len(x), per):
            # each run's logits and gradient let go before the next's are made (`backward_bytes`
            # counts what is held)
            t = targets[lo : lo + per] - ctx.start
            mine = (t >= 0) & (t < len(w)) if ctx.split else torch.ones_like(t, dtype=torch.bool)
            g = ctx.kernels.grad(x[lo : lo + per], w, lse[lo : lo + per], t, mine,
                                 grad_loss[lo : lo + per])
            grad_x[lo : lo + per] = g @ w
            _add_product(grad_w, g.T, x[lo : lo + per])
            del g
        return (grad_x.to(hidden.dtype), grad_w.to(weight.dtype), None, None, None, None, None,
                None)


# Whether this torch has matmuls that add a half-precision product into fp32 (torch >= 2.8).
MM_INTO_FP32 = "dtype_out" in torch.ops.aten.addmm.overloads()


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, `acc` fp32. On a GPU one matmul adds into `acc` in place, in cuBLAS's fp32
    sum (a half product would first be rounded to 8 bits of mantissa: 1.7e-3 relative against
    2e-6, and on an H100 1.7 ms a 2,093-token run of the 1B head against 2.6). Elsewhere (the CPU
    has no such kernel) the product, in the matmul's dtype, is added (`backward_bytes` counts
    it)."""
    if acc.is_cuda and (a.dtype == acc.dtype or MM_INTO_FP32):
        kwargs = {} if a.dtype == acc.dtype else {"out_dtype": acc.dtype}
        torch.addmm(acc, a, b, out=acc, **kwargs)
    else:
        acc.add_(a @ b)


def backward_bytes(tokens: int, vocab: int, dim: int, per: int, matmul: int, hidden: int,
                   weight: int, compiled: bool = False, into_fp32: bool = False) -> int:
    """Bytes `LinearCrossEntropy.backward` holds at its most besides what it was given: over
    `tokens` tokens, `vocab` (local) head rows of width `dim`, `per` tokens a run, with element
    sizes `matmul` (its matmuls'), `hidden` and `weight` (its inputs'). Throughout: the inputs'
    casts to the matmul dtype (where they differ), grad_x (matmul dtype) and grad_w (fp32). At
    the most, one of: a run's fp32 logits and the half-precision product they came from (then
    the gradient cast back beside them: the same), a run's cast gradient and its weight-gradient
    product, or at the end the gradients cast to the inputs' dtypes. (The runs' index tensors,
    a few bytes per token, are not counted.) `compiled` (`compiled_kernels`): a run's product and
    its gradient, in the matmul's dtype, no fp32 copy; `into_fp32` (a GPU: `_add_product`): the
    weight gradient's product is added by the matmul itself, never held. Measured on a CPU for
    the eager runs (tests/unit/test_head_loss.py); the others follow the code."""
    x, w, run = tokens * dim, vocab * dim, min(per, tokens) * vocab
    held = (hidden != matmul) * x * matmul + (weight != matmul) * w * matmul + x * matmul + 4 * w
    half = matmul != 4
    logits = 2 * matmul * run if compiled else (4 + half * matmul) * run
    loop = max(logits, matmul * (run + (not into_fp32) * w))
    end = (hidden != matmul) * x * hidden + (weight != 4) * w * weight
    return held + max(loop, end)


def linear_cross_entropy(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor,
                         group: ProcessGroup | None = None, vocab_size: int = 0,
                         block: int = 0, kernels: RunKernels = EAGER) -> torch.Tensor:
    """Mean cross-entropy over the tokens of `head(hidden)` ((b, s, dim) hidden states, a
    bias-free head, (b, s) targets) without the whole logits (`LinearCrossEntropy`); `group`:
    a vocabulary-split head's (its input as its forward receives it); `block`: logits at a time
    (0: the device's `logit_block`); `kernels`: the runs' arithmetic (`compiled_kernels`)."""
    device = hidden.device.type
    dtype = matmul_dtype(device, head.weight)
    start = vocab_range(vocab_size, group)[0] if group is not None else 0
    per = run_tokens(head.weight.shape[0], device, block)
    with torch.autocast(device, enabled=False):
        losses = LinearCrossEntropy.apply(hidden.flatten(0, 1), head.weight, targets.flatten(),
                                          dtype, per, group, start, kernels)
    return losses.mean()


class HeadCrossEntropy:
    """plait's loss for a model whose plan names its output head: `(logits, targets)` -> the
    mean cross-entropy of a head's logits (whole, or vocabulary-split over `group`), and
    `fused(hidden, head, targets)`, the same from the head's input without ever holding the
    logits (`linear_cross_entropy`): what the pipeline's last chunk computes in training and
    evaluation."""

    def __init__(self, group: ProcessGroup | None = None, vocab_size: int = 0):
        self.group, self.vocab_size = group, vocab_size
        self.kernels = EAGER  # the fused loss's per-run arithmetic; `compile` sets it

    def compile(self, backend: str) -> None:
        """The fused loss's per-run arithmetic through `torch.compile` (`train.compile`)."""
        self.kernels = compiled_kernels(backend)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return vocab_parallel_cross_entropy(logits, targets, self.group, self.vocab_size)

    def fused(self, hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor) -> torch.Tensor:
        """Logits of one run at most (`fits_one_run`) are made and kept, as the unfused loss
        keeps them: fusing would only add the backward's second matmul. A head that soft-caps
        its logits (`logit_softcap`: Gemma2's) is not fused: its logits are made whole."""
        cap = getattr(head, "logit_softcap", None)
        if head.bias is not None or cap is not None or \
                fits_one_run(targets.numel(), head.weight.shape[0], hidden.device.type):
            return self(softcapped(F.linear(hidden, head.weight, head.bias), cap), targets)
        return linear_cross_entropy(hidden, head, targets, self.group, self.vocab_size,
                                    kernels=self.kernels)


def fits_one_run(tokens: int, vocab: int, device: str) -> bool:
    """Whether a micro-batch's logits over a (local) vocabulary are one run at most on a device
    of this kind."""
    return tokens * vocab <= logit_block(device)
