"""A plain single-device Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Nothing here is distributed. Parallelisms in `plait.parallel` transform this model in place, so the
module and parameter names below are a contract: a pipeline stage that keeps `layers.4` or a
tensor-parallel shard of `layers.0.attention.wq` finds its weights under the same name.

Weights are initialised per parameter from a generator seeded by (seed, parameter name)
(`init_weights`), so they do not depend on construction order, on the device the model was built
on, or on how the model will later be split.
"""

from __future__ import annotations

import contextlib
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from plait.model.args import PRESETS, ModelArgs, model_args  # noqa: F401 - re-exported
from plait.model.documents import Documents
from plait.model.feed_forward import FeedForward
from plait.model.llama_plan import LLAMA
from plait.model.moe import MoEFeedForward


class RootMeanSquareNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019): x / rms(x) * weight, no bias."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor) or isinstance(self.weight, DTensor):
            # The plain composition: torch's sequence parallelism (bench step's peer) gives it
            # DTensors. (torch.compile traces `Normalize`, its backward too.)
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return xf.type_as(x) * self.weight
        return Normalize.apply(x, self.weight, self.eps)


class Normalize(torch.autograd.Function):
    """x / rms(x) * weight, normalized in fp32 even under bf16 (the mean of squares loses too
    much in bf16), keeping for backward what a fused norm keeps: x and each row's 1 / rms(x) in
    fp32. Autograd's composition of the same operations also kept x / rms(x) (fp32, and a bf16
    copy where x is bf16); the backward makes it again from x and runs autograd's own formulas
    for those operations, in its order (mul, rsqrt, mean, pow: torch's derivatives.yaml), so
    its gradients are the composition's, an overflow's NaN included (a diverging run's norm of
    squares turns inf: 1 / rms(x) is 0, and inf times 0 is what stops the run)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        inverse = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, inverse)
        return (x.float() * inverse).type_as(x) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, inverse = ctx.saved_tensors
        xf = x.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            rows = tuple(range(grad.dim() - 1))
            grad_weight = (grad * (xf * inverse).type_as(x)).sum(rows).to(weight.dtype)
        gn = (grad * weight).float()  # through `* weight`, then `type_as`
        # through `xf * inverse`: to xf directly, and to inverse (summed over the row)
        grad_inverse = (gn * xf).sum(-1, keepdim=True)
        grad_mean = -0.5 * grad_inverse * inverse.pow(3)  # rsqrt's
        grad_square = grad_mean.expand(xf.shape) / xf.shape[-1]  # mean's
        grad_x = gn * inverse + grad_square * (2 * xf.pow(1))  # + pow's
        return grad_x.to(x.dtype), grad_weight, None


def sequence_positions(seq_len: int, device) -> torch.Tensor:
    """The positions of a forward's tokens in their sequence: 0 .. seq_len - 1. A model's
    `positions` attribute; context parallelism replaces it by its shard's positions."""
    return torch.arange(seq_len, device=device)


def rope_tables(positions: torch.Tensor, head_dim: int,
                theta: float) -> tuple[torch.Tensor, ...]:
    """cos and sin of the rotary angles (Su et al. 2021) at `positions` (seq) or (rows, seq,
    each row its own: documents restart them): each (..., seq, head_dim/2)."""
    device = positions.device
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = positions.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) by position; pairs are (even, odd) features. cos and
    sin: (seq, head_dim/2), or (batch, seq, head_dim/2)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # each (b, s, h, head_dim / 2)
    cos, sin = cos[..., None, :], sin[..., None, :]  # a heads dimension
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class CausalAttention(nn.Module):
    """The attention kernel: `causal_attention` as a module (no weights), the swap point of
    context parallelism (`attention.core.kernel`), which replaces it by a kernel that attends
    across the sequence shards of the cp ranks. Every kernel takes the micro-batch's `Documents`
    too, under `data.document_mask` (model/documents.py)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        return causal_attention(q, k, v,
                                None if documents is None else documents.additive(q.dtype))


class AttentionCore(nn.Module):
    """Rotary embedding and causal attention: q (b, s, heads, head_dim), k and v
    (b, s, kv_heads, head_dim) -> (b, s, heads * head_dim). No weights; a module of its own so that
    selective activation checkpointing can recompute it (cheap, but its saved tensors are
    large)."""

    def __init__(self):
        super().__init__()
        self.kernel = CausalAttention()

    def forward(self, q, k, v, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.kernel(q, k, v) if documents is None else self.kernel(q, k, v, documents)
        return out.flatten(-2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim) + causal mask) v over whole sequences: q (b, s, heads, d),
    k and v (b, s, kv_heads, d), each key/value head shared by heads / kv_heads query heads
    -> (b, s, heads, d). `mask` (b, 1, s, s), added to the scores (0 where a query sees a key,
    -inf elsewhere), replaces the causal one (document masking). The kernel reads each key/value
    head for its group of query heads (`enable_gqa`): k and v are kept for backward at their own
    head count, not repeated to every query head."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        is_causal=mask is None, enable_gqa=k.shape[2] != q.shape[2],
    )  # (b, heads, s, head_dim)
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Causal grouped-query attention (Ainslie et al. 2023): n_kv_heads key/value heads shared by
    n_heads / n_kv_heads query heads each."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        # Head counts come from the weight shapes, not the config, so the same code runs on a
        # tensor-parallel shard that holds a subset of the heads.
        q = self.wq(x).unflatten(-1, (-1, self.head_dim))  # (b, s, heads, head_dim)
        k = self.wk(x).unflatten(-1, (-1, self.head_dim))  # (b, s, kv_heads, head_dim)
        v = self.wv(x).unflatten(-1, (-1, self.head_dim))
        return self.wo(self.core(q, k, v, cos, sin, documents))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + ffn(norm(.))."""

    def __init__(self, args: ModelArgs, moe: bool = False):
        super().__init__()
        self.attention_norm = RootMeanSquareNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RootMeanSquareNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args) if not moe else MoEFeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, documents)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab). Untied input and output embeddings, so a
    pipeline's first and last stages own their tables outright."""

    plan = LLAMA  # what the parallelisms need to know of it (plait/model/llama_plan.py)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by the global layer index keeps names stable when a pipeline stage
        # keeps only some of the layers.
        self.layers = nn.ModuleDict({str(i): Block(args, args.is_moe(i))
                                     for i in range(args.n_layers)})
        self.norm = RootMeanSquareNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.positions = sequence_positions  # (seq_len, device) -> the tokens' positions

    # The forward in three pieces, which a pipeline chunk runs on the modules it holds (the
    # plan's `first`, blocks, `last` and `shared`, under the same names).
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)  # (b, s) -> (b, s, dim)

    def block_args(self, h: torch.Tensor, seq_len: int,
                   documents: Documents | None = None) -> tuple:
        """What every block takes besides the hidden states: the rotary tables of the tokens'
        positions (this cp rank's, under context parallelism); with `documents`, positions
        that restart at each document, and the documents for the attention kernel's mask."""
        if documents is None:
            positions = self.positions(seq_len, h.device)
            return rope_tables(positions, self.args.head_dim, self.args.rope_theta)
        documents = documents.to(h.device)
        tables = rope_tables(documents.positions(), self.args.head_dim, self.args.rope_theta)
        return (*tables, documents)

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)  # what the output head reads (a pipeline chunk calls it unbound)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h))  # (b, s, dim) -> (b, s, vocab)

    def forward(self, tokens: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """`documents`: where the windows' documents begin (`data.document_mask`)."""
        h = self.embed(tokens)
        extra = self.block_args(h, tokens.shape[1], documents)
        for layer in self.layers.values():
            h = layer(h, *extra)
        return self.head(h)


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


BLOCK = 2**20  # elements drawn from one generator: a tensor's rows are drawn block by block


def block_rows(shape: tuple[int, ...]) -> int:
    """Rows (indices of dim 0) per block of `shape`: as many as fit in BLOCK elements, at least
    one."""
    row = math.prod(shape[1:])
    return max(1, BLOCK // max(row, 1))


def init_std(name: str, n_layers: int) -> float | None:
    """The init of parameter `name`: N(0, std), or None for ones (norm gains)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("attention.wo.weight", ".w2.weight")):  # dense or expert feed-forward
        return 0.02 / math.sqrt(2 * n_layers)
    return 0.02


def init_rows(seed: int, n_layers: int, name: str, shape: tuple[int, ...], lo: int,
              hi: int) -> torch.Tensor:
    """Rows [lo, hi) (of dim 0) of parameter `name`'s initial value, a tensor of `shape`, on the
    CPU in fp32, drawn without drawing the rest: block b of `block_rows(shape)` rows comes from
    its own generator, seeded by (seed, name) for block 0 and (seed, name#b) after it (so a tensor
    of one block is one draw of its whole shape)."""
    std = init_std(name, n_layers)
    if std is None:
        return torch.ones((hi - lo, *shape[1:]))
    rows = block_rows(shape)
    parts = []
    for b in range(lo // rows, -(-hi // rows)):
        start, stop = b * rows, min((b + 1) * rows, shape[0] if shape else 1)
        g = torch.Generator().manual_seed(_param_seed(seed, name if b == 0 else f"{name}#{b}"))
        block = torch.randn((stop - start, *shape[1:]), generator=g)
        parts.append(block[max(lo, start) - start : min(hi, stop) - start])
    return torch.cat(parts) * std if len(parts) > 1 else parts[0] * std


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, n_layers: int) -> None:
    """Deterministic init keyed by parameter name: N(0, 0.02) for embeddings and projections into
    the residual stream's inputs, N(0, 0.02 / sqrt(2 * n_layers)) for the two projections that
    write into the residual stream (GPT-2's scaled init), ones for norms.

    Each tensor is drawn on the CPU (`init_rows`, in blocks of rows) and copied in, so the same
    name gets the same values whatever device or dtype the model lives on, and a rank that holds
    a slice of it draws the slice alone (`plait.model.materialize`).
    """
    for name, p in model.named_parameters():
        p.copy_(init_rows(seed, n_layers, name, tuple(p.shape), 0, p.shape[0]))


def build_model(args: ModelArgs, seed: int, device: torch.device | str = "cpu") -> Llama:
    """Build and initialise. On `meta`, only shapes exist and init is skipped (torch's own
    `reset_parameters` too: `init_weights` replaces its values anyway, and on `meta` there are
    none; the planner builds a model per layout it prices)."""
    meta = torch.device(device).type == "meta"
    with torch.device(device), _torch_init_skipped() if meta else contextlib.nullcontext():
        model = Llama(args)
    if not meta:
        init_weights(model, seed, args.n_layers)
    return model


@contextlib.contextmanager
def _torch_init_skipped():
    """nn.Linear's and nn.Embedding's constructors without their default init."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if exclude_embedding and hasattr(model, "tok_embeddings"):
        n -= model.tok_embeddings.weight.numel()
    return n
