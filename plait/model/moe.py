"""A mixture-of-experts feed-forward (Shazeer et al. 2017), plain and single-device.

A router (a bias-free linear layer, computed in fp32) gives each of a forward's N tokens a
probability over E experts, each a SwiGLU feed-forward like the dense one. Two routers:

- token choice (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): each token goes to its
  top-k experts, gate weights = their probabilities (renormalised to sum to 1 when k > 1). With a
  capacity factor c > 0, each expert takes at most C = ceil(c * N * k / E) of a routing group's N
  tokens. The rule: assignments are served in priority order, every token's first choice before
  any token's second choice, then by token position; an expert's assignments past C are dropped.
- expert choice (Zhou et al. 2022): each expert takes its top C tokens by probability (C as above,
  with c = 1 when unset), gate weight = that probability; a token may get any number of experts.

Routing ranks scores at a stated precision: probabilities rounded to multiples of 2^-16
(`RANK_STEP`), then ties go to the lower index (stable sorts; the lower expert under token choice,
the earlier token of the routing group under expert choice). Why: tokens with identical contexts
(a window's first byte, a document's BOS) have equal probabilities in exact arithmetic, but a
matmul can round two rows of one input differently (a kernel's tail rows), and two layouts or two
machines differ in the last bits; ranked raw, such a tie goes to whichever token the last bit
favours, so the same scores up to rounding noise routed differently on another machine. Rounded,
a tie stays a tie (unless it straddles a grid point: odds ~ noise / 2^-16, ~1e-3 for a last-bit
difference) and the index decides. Values nearer than 2^-16 that are not ties become ties too:
a bias of at most 2^-16 in a score, in favour of the lower index.
A token that no expert takes passes through on the residual: the layer outputs 0 for it.

Load balancing (Switch, eq. 4): aux = E * sum_i f_i * P_i, f_i the fraction of the router's picks
(before capacity) that chose expert i, P_i the mean probability of expert i; 1 when balanced.
Router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): the mean over tokens of logsumexp(logits)^2.
Neither changes the layer's output: their gradient is attached to it (`AttachLoss`), times
`grad_scale` (the micro-batch's share of the loss), and their values are kept in `stats`.

Swap points, for `plait.parallel.expert_parallel` (here: the single-device behaviour):

- `dispatch(tokens, routing, experts)`: runs the experts on their tokens (here: a loop);
- `reduce(t)`: sums routing statistics over the ranks that share the batch, so that f_i and P_i
  are the whole batch's (here: the identity);
- `route_groups`: how many routing groups (contiguous runs of rows) a forward's tokens form, each
  routed with its own capacity. A parallel run routes each rank's micro-batch as one group; a
  single-process reference of it sets `route_groups` to the number of such ranks.

Fake tokens (a trace before launch, `plait.predict.trace`: shapes without values) are routed
evenly, which is what a plan prices: each routing group's N k picks spread over the E experts
(the first N k mod E experts one more), each expert keeping at most C; every operation runs as
on real tokens, with the counts (`Routing.counts`) known where a real routing reads them. Expert
choice at capacity factor 1 routes evenly on real tokens too, so there the trace is the run's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from plait.model.args import ModelArgs
from plait.model.feed_forward import FeedForward

RANK_STEP = 2.0**-16  # the precision at which routing compares probabilities


def rank_key(scores: torch.Tensor) -> torch.Tensor:
    """What routing sorts by: `scores` rounded to multiples of RANK_STEP (division and
    multiplication by a power of two are exact, so only the rounding moves a value)."""
    return torch.round(scores.detach() / RANK_STEP) * RANK_STEP


@dataclass
class Routing:
    """A forward's kept token-to-expert assignments, sorted by expert (within an expert in
    priority order), and what the router wanted before capacity."""

    token: torch.Tensor  # (A,) token index
    expert: torch.Tensor  # (A,) expert index
    weight: torch.Tensor  # (A,) gate weight (differentiable)
    picked: torch.Tensor  # (E,) the router's picks per expert, before capacity
    kept: torch.Tensor  # (E,) assignments per expert, after capacity
    dropped: int  # tokens that no expert takes
    counts: list[int] | None = None  # `kept` as ints where it holds no values (fake tokens)

    def kept_counts(self) -> list[int]:
        return self.counts if self.counts is not None else self.kept.tolist()


@dataclass
class RouterStats:
    """One forward's routing over the whole batch (after `reduce`)."""

    aux_loss: float
    z_loss: float
    dropped: float  # fraction of tokens no expert took
    kept: torch.Tensor  # (E,) assignments per expert


def capacity(tokens: int, k: int, experts: int, factor: float) -> int | None:
    """Assignments one expert may take from a routing group: ceil(factor * tokens * k / E);
    None (no limit) for factor 0."""
    return math.ceil(factor * tokens * k / experts) if factor > 0 else None


def even(total: int, parts: int) -> list[int]:
    """`total` spread over `parts`, the first `total % parts` one more."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _counted(counts: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.long, device=like.device)


class _Selected(torch.autograd.Function):
    """`t[keep]` for a fake `t` (a trace), whose mask holds no count: `count` rows, keeping the
    mask for backward as indexing does."""

    @staticmethod
    def forward(ctx, t, keep, count):
        ctx.save_for_backward(keep)
        return t.new_empty(count, *t.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad.new_zeros(keep.shape), None, None


def _by_expert(token, expert, weight, picked, n_experts: int, n_tokens: int,
               counts: list[int] | None = None) -> Routing:
    order = torch.sort(expert, stable=True).indices
    token, expert, weight = token[order], expert[order], weight[order]
    if counts is not None:  # fake tokens: the even routing's counts
        return Routing(token, expert, weight, picked, _counted(counts, token), 0, counts)
    kept = torch.bincount(expert, minlength=n_experts)
    taken = torch.zeros(n_tokens, dtype=torch.bool, device=token.device)
    taken[token] = True
    return Routing(token, expert, weight, picked, kept, int(n_tokens - taken.sum()))


def token_choice(probs: torch.Tensor, k: int, cap: int | None,
                 scores: torch.Tensor | None = None) -> Routing:
    """Top-k experts per token of (N, E) probabilities, at most `cap` assignments per expert.
    The choice ranks `scores` (default: the probabilities); the gates are `probs`'."""
    n, e = probs.shape
    key = rank_key(probs if scores is None else scores)
    top = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :k]
    weight = probs.gather(1, top)  # (N, k)
    if k > 1:
        weight = weight / weight.sum(-1, keepdim=True)
    # Priority order: choice rank, then token.
    expert = top.t().reshape(-1)
    token = torch.arange(n, device=probs.device).repeat(k)
    weight = weight.t().reshape(-1)
    fake = isinstance(probs, FakeTensor)
    counts = even(n * k, e) if fake else None
    picked = _counted(counts, expert) if fake else torch.bincount(expert, minlength=e)
    if cap is not None:
        seen = F.one_hot(expert, e).cumsum(0).gather(1, expert[:, None]).squeeze(1)
        keep = seen <= cap  # this assignment is its expert's seen-th
        if fake:
            counts = [min(c, cap) for c in counts]
            token, expert, weight = (_Selected.apply(t, keep, sum(counts))
                                     for t in (token, expert, weight))
        else:
            token, expert, weight = token[keep], expert[keep], weight[keep]
    return _by_expert(token, expert, weight, picked, e, n, counts)


def expert_choice(probs: torch.Tensor, cap: int, scores: torch.Tensor | None = None) -> Routing:
    """Each expert's top `cap` tokens of (N, E) probabilities, ranked by `scores` (default: the
    probabilities); the gates are `probs`'."""
    n, e = probs.shape
    cap = min(cap, n)
    key = rank_key(probs if scores is None else scores).t()  # (E, N)
    token = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :cap]
    weight = probs.t().gather(1, token).reshape(-1)
    expert = torch.arange(e, device=probs.device).repeat_interleave(cap)
    picked = torch.full((e,), cap, dtype=torch.long, device=probs.device)
    counts = [cap] * e if isinstance(probs, FakeTensor) else None
    return _by_expert(token.reshape(-1), expert, weight, picked, e, n, counts)


def aux_loss(picked: torch.Tensor, mean_probs: torch.Tensor) -> torch.Tensor:
    """Switch's load-balancing loss E * sum_i f_i * P_i from the picks per expert (f_i = picks
    of i / all picks) and the mean router probabilities P_i."""
    f = picked.to(mean_probs.dtype) / picked.sum()
    return picked.numel() * (f * mean_probs).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


def run_experts(x: torch.Tensor, counts: list[int], experts: nn.ModuleDict,
                first: int) -> torch.Tensor:
    """Rows of `x` grouped by expert, counts[i] of them for expert first + i, through their
    experts; an expert with no rows still runs (its gradient is zero, not missing)."""
    parts = x.split(counts)
    return torch.cat([experts[str(first + i)](part) for i, part in enumerate(parts)])


# Eager under train.compile (parallel/compile.py): the rows each expert gets are known only when
# the routing has run, and a graph of them would be recompiled for each batch's counts.
@torch.compiler.disable
def _dispatch(dispatch: Callable, tokens: torch.Tensor, routing: Routing,
              experts: nn.ModuleDict) -> torch.Tensor:
    return dispatch(tokens, routing, experts)


def local_dispatch(tokens: torch.Tensor, routing: Routing, experts: nn.ModuleDict) -> torch.Tensor:
    """Every expert on this device: (A, dim) expert outputs, in the routing's order."""
    return run_experts(tokens[routing.token], routing.kept_counts(), experts, 0)


class AttachLoss(torch.autograd.Function):
    """Forward: x unchanged. Backward: x's gradient, and a gradient of 1 for `loss`, so that an
    auxiliary loss trains the router wherever in the model (or pipeline) it is computed."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.loss_like = loss
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones_like(ctx.loss_like)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class MoEFeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_experts, self.top_k = args.moe_experts, args.moe_top_k
        self.capacity_factor, self.router_kind = args.moe_capacity_factor, args.moe_router
        self.aux_coef, self.z_coef = args.moe_aux_loss_coef, args.moe_z_loss_coef
        self.router = nn.Linear(args.dim, args.moe_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): FeedForward(args) for e in range(args.moe_experts)})
        self.dispatch: Callable = local_dispatch
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.route_groups = 1
        self.grad_scale = 1.0
        self.loss_scale = 1.0  # fp16: the main loss's scale, which the auxiliary losses share
        self.stats: list[RouterStats] = []  # one per training forward; the trainer clears it

    def route(self, probs: torch.Tensor, scores: torch.Tensor | None = None) -> Routing:
        """Route (N, E) probabilities, each routing group on its own; the choices rank `scores`
        (default: the probabilities themselves), the gates are `probs`'."""
        groups = probs.chunk(self.route_groups)
        ranked = (probs if scores is None else scores).chunk(self.route_groups)
        n = groups[0].shape[0]
        parts = []
        for group, by in zip(groups, ranked, strict=True):
            cap = capacity(n, self.top_k, self.n_experts, self.capacity_factor)
            if self.router_kind == "expert_choice":
                parts.append(expert_choice(group, cap or capacity(n, self.top_k,
                                                                  self.n_experts, 1.0), by))
            else:
                parts.append(token_choice(group, self.top_k, cap, by))
        if len(parts) == 1:
            return parts[0]
        counts = None if parts[0].counts is None else \
            [sum(c) for c in zip(*(p.counts for p in parts), strict=True)]
        return _by_expert(torch.cat([p.token + i * n for i, p in enumerate(parts)]),
                          torch.cat([p.expert for p in parts]),
                          torch.cat([p.weight for p in parts]),
                          sum(p.picked for p in parts), self.n_experts, len(probs), counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        with torch.autocast(tokens.device.type, enabled=False):  # routing in fp32
            logits = F.linear(tokens.float(), self.router.weight.float())
        probs = logits.softmax(-1)
        routing = self.route(probs)
        z, e = z_loss(logits), self.n_experts
        total = self.reduce(torch.cat([
            routing.picked.double(), routing.kept.double(), probs.detach().double().sum(0),
            torch.tensor([routing.dropped, len(tokens)], dtype=torch.float64,
                         device=tokens.device), z.detach().double()[None] * len(tokens)]))
        picked, kept, prob_sum = total[:e], total[e : 2 * e], total[2 * e : 3 * e]
        dropped, n, z_sum = total[3 * e :]
        # This rank's part of the aux loss: the global f_i with its own tokens' P_i (the mean of
        # the parts over equally sized ranks is the global loss, and its gradient theirs).
        aux = aux_loss(picked, probs.mean(0))
        y = _dispatch(self.dispatch, tokens, routing, self.experts)
        out = torch.zeros_like(tokens).index_add(0, routing.token,
                                                 (y * routing.weight[:, None]).to(tokens.dtype))
        if torch.is_grad_enabled() and (self.aux_coef or self.z_coef):
            out = AttachLoss.apply(out, (self.aux_coef * aux + self.z_coef * z)
                                   * (self.grad_scale * self.loss_scale))
        if self.training and routing.counts is None:  # (fake tokens have no statistics)
            self._record(picked, prob_sum, z_sum, dropped, n, kept)
        return out.view_as(x)

    # Eager under train.compile: reading numbers to the host breaks a graph at each, and the
    # graphs resumed after them were recompiled every step.
    @torch.compiler.disable
    def _record(self, picked, prob_sum, z_sum, dropped, n, kept) -> None:
        self.stats.append(RouterStats(
            aux_loss=aux_loss(picked, prob_sum / n).item(), z_loss=(z_sum / n).item(),
            dropped=(dropped / n).item(), kept=kept.detach().cpu()))
