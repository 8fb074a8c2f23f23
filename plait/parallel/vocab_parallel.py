"""Vocabulary parallelism: the embedding table and the output head split by vocabulary rows over
the `tp` axis, and a cross-entropy that never gathers the full logits (Megatron-LM, Shoeybi et al.
2019, section 3: "parallelize the input embedding ... fuse the output with the cross entropy").

Rank r holds vocabulary rows [r V / T, (r + 1) V / T).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup, ReduceOp

from plait.comm import all_reduce
from plait.comm.autograd import reduce_from_tp, reduce_scatter_to_sp
from plait.mesh import Axis


def vocab_range(vocab_size: int, group: ProcessGroup) -> tuple[int, int]:
    per = vocab_size // dist.get_world_size(group)
    start = dist.get_rank(group) * per
    return start, start + per


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the tokens in its rows (zeros for the others); the partial embeddings are
    summed across `tp` (all-reduce, or reduce-scatter to sequence shards under sequence
    parallelism)."""

    def __init__(self, full: nn.Embedding, tp: Axis, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = tp.group, sequence_parallel
        per = full.num_embeddings // tp.size
        self.start, self.end = tp.rank * per, (tp.rank + 1) * per
        self.weight = nn.Parameter(full.weight.detach()[self.start : self.end].clone())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)  # (b, s, h)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(partial, self.group)  # (b, s / T, h)
        return reduce_from_tp(partial, self.group)


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
