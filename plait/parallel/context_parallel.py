"""Context parallelism over the `cp` axis: every sequence is split over the C ranks of the axis,
so the activations of a long sequence are held 1/C per rank. Only attention mixes tokens; its core
(the model plan's `attention_core`, its attention kernel) is replaced by one that attends across
the shards.

- `ring` (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): each rank keeps its
  queries and passes its key/value block around the ring; after C - 1 shifts every query block has
  met every key/value block. Blocks are merged by their log-sum-exp (the online softmax of flash
  attention), one block's attention computed at a time. The next block's transfer is in flight
  while the current one is computed. The backward passes the key/value blocks around
  again, with the gradient of each block travelling with it, and a last shift brings each block's
  gradient home. Causal load balance: the sequence is cut into 2C chunks and rank i holds chunks
  i and 2C-1-i (one early, one late), so every rank computes the same number of blocks and the
  same number of unmasked scores (`ring_blocks`). Grouped-query attention sends the key/value
  heads only.
- `ulysses` (Jacobs et al. 2023, "DeepSpeed Ulysses"): an all-to-all turns q, k and v from a
  sequence shard of every head into the whole sequence of 1/C of the heads, attention runs as on
  one device, and one more all-to-all turns the output back (four per layer, and four in
  backward). Rank i holds the contiguous chunk i. Key/value heads that C does not divide are
  repeated to the query heads first.

Rotary positions follow the shard (`ContextLayout.positions`, the model's `positions`); the data
is cut the same way (`ContextLayout.shard`). Under `data.document_mask` every rank keeps the
whole window's documents (model/documents.py): the ring masks each block by its queries' and the
sending rank's keys' positions and skips a block no query sees; Ulysses masks the whole window.
The loss is each rank's mean over its tokens, equal counts on every rank, so the mean of the cp
ranks' gradients (the data-parallel engine averages dense gradients over dp x cp) is the gradient
of the mean over the whole sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed import ProcessGroup

from plait.comm import shift
from plait.comm.autograd import heads_to_seq, seq_to_heads
from plait.config.choices import CP_METHODS
from plait.mesh import Axis
from plait.model.documents import Documents
from plait.model.llama import causal_attention
from plait.model.plan import needs_plan


@dataclass(frozen=True)
class ContextLayout:
    """Which tokens of a sequence this cp rank holds."""

    method: str  # "ring" | "ulysses"
    rank: int
    size: int

    @property
    def pieces(self) -> int:
        """The sequence is cut into this many equal chunks: 2C for the ring, C for Ulysses."""
        return 2 * self.size if self.method == "ring" else self.size

    def chunks(self, rank: int | None = None) -> tuple[int, ...]:
        """The chunks `rank` (default: this one) holds, in order."""
        r = self.rank if rank is None else rank
        return (r, 2 * self.size - 1 - r) if self.method == "ring" else (r,)

    def index(self, seq_len: int, device=None, rank: int | None = None) -> torch.Tensor:
        """Positions in the whole sequence of the tokens `rank` holds, in its order."""
        c = seq_len // self.pieces
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                          for i in self.chunks(rank)])

    def positions(self, local_len: int, device) -> torch.Tensor:
        """The model's `positions` under context parallelism: of this rank's `local_len` tokens."""
        return self.index(local_len * self.size, device)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of (rows, seq, ...) `x` (a copy; `x` itself at C = 1)."""
        if self.size == 1:
            return x
        return x.index_select(1, self.index(x.shape[1], x.device))


def ring_blocks(rank: int, size: int, local_len: int):
    """The ring's work on `rank`, step by step: (source rank of the key/value block, query rows,
    key/value rows, causal?), rows as slices of the local sequence (its two chunks, early then
    late). Step 0 is the rank's own block, under the causal mask. A block from an earlier rank
    holds one chunk before both of ours and one after both: every query meets its first chunk. A
    block from a later rank holds two chunks after our early one and before our late one: our
    late chunk meets all of it. The pairings left out lie entirely in the future."""
    c, whole = local_len // 2, slice(None)
    for step in range(size):
        src = (rank - step) % size
        if step == 0:
            yield src, whole, whole, True
        elif src < rank:
            yield src, whole, slice(0, c), False
        else:
            yield src, slice(c, None), whole, False


def attend_block(q, k, v, scale: float, mask: torch.Tensor | None = None):
    """One block of attention with its log-sum-exp: q (..., sq, d), k and v (..., sk, d), `mask`
    (sq, sk) True where a query may see a key -> (out (..., sq, d), lse (..., sq)). A query that
    sees no key gets out 0 and lse -inf, which `merge` then ignores."""
    scores = _scores(q, k, scale, mask)
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - _finite(lse)[..., None])
    return probs @ v, lse


def _scores(q, k, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """q k^T * scale, -inf where `mask` is False."""
    scores = (q @ k.transpose(-1, -2)) * scale
    return scores if mask is None else scores.masked_fill(~mask, -math.inf)


def _causal(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor | None:
    """The ring's own block's mask on its local order (its positions increase along it)."""
    if not causal:
        return None
    return torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()


def merge(out, lse, block_out, block_lse):
    """Two partial attentions over disjoint key sets -> the attention over both (the online
    softmax: each weighted by its share of the total exp-sum)."""
    total = torch.logaddexp(lse, block_lse)
    shift_by = _finite(total)
    return (out * torch.exp(lse - shift_by)[..., None]
            + block_out * torch.exp(block_lse - shift_by)[..., None]), total


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """-inf (no key seen) -> 0, so that exp(x - lse) is exp(-inf) = 0 rather than nan."""
    return lse.masked_fill(lse == -math.inf, 0.0)


# The block kernel on CPU: torch's fused flash-attention kernel, which returns the log-sum-exp and
# takes it back in backward (as torch's own ring attention uses the CUDA ones). Elsewhere, and
# with this off (tests compare both), the plain math of `attend_block`.
FUSED_CPU = True


def _fused(q: torch.Tensor) -> bool:
    return FUSED_CPU and q.device.type == "cpu"


def _block(q, k, v, causal: bool, scale: float, mask: torch.Tensor | None = None):
    """Attention of q (b, h, sq, d) over k, v (b, h, sk, d), causal on the local order (the
    ring's own block: its positions increase along it), or by `mask` (b, 1, sq, sk) where given
    (documents) -> (out fp32, lse fp32 (b, h, sq))."""
    if not _fused(q):
        return attend_block(q.float(), k.float(), v.float(), scale,
                            _causal(q, k, causal) if mask is None else mask)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal and mask is None, scale=scale, **_masked(mask, q.dtype))
    if mask is not None:  # the kernel says 0 for a query that sees no key: no weight in a merge
        lse = lse.masked_fill(~mask.any(-1), -math.inf)
    return out.float(), lse


def _masked(mask: torch.Tensor | None, dtype: torch.dtype) -> dict:
    """The fused kernel's `attn_mask` for a boolean mask: 0 where a query sees a key, -inf
    elsewhere, in the queries' dtype."""
    if mask is None:
        return {}
    return {"attn_mask": torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            .masked_fill(~mask, -math.inf)}


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float,
                    mask: torch.Tensor | None = None):
    """Gradients of one block's q, k, v (fp32) given the *whole* attention's output and
    log-sum-exp for these queries: each block's share of softmax's backward."""
    if _fused(q):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal and mask is None, scale=scale,
            **_masked(mask, q.dtype))
        return (g.float() for g in grads)
    q, k, v, dout, out = q.float(), k.float(), v.float(), dout.float(), out.float()
    mask = _causal(q, k, causal) if mask is None else mask
    probs = torch.exp(_scores(q, k, scale, mask) - _finite(lse)[..., None])
    delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O), per query
    dscores = probs * (dout @ v.transpose(-1, -2) - delta) * scale
    return dscores @ k, dscores.transpose(-1, -2) @ q, probs.transpose(-1, -2) @ dout


def _heads(kv: torch.Tensor, which: int, group: int, rows: slice) -> torch.Tensor:
    """Keys (0) or values (1) of a (2, b, s, kv_heads, d) message, the `rows` the block needs,
    repeated to every query head -> (b, heads, rows, d)."""
    return kv[which][:, rows].repeat_interleave(group, dim=2).transpose(1, 2)


def _kv_grad(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, heads, s, d) gradient of repeated keys or values -> (b, s, kv_heads, d), summed over
    each key/value head's query heads."""
    return grad.unflatten(1, (kv_heads, -1)).sum(2).transpose(1, 2)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole (load-balanced) sequence: q
    (b, s, heads, d), k and v (b, s, kv_heads, d), the rank's two chunks -> (b, s, heads, d).
    Blocks are merged in fp32; keys and values travel in their dtype, their gradients in fp32.
    With `documents` each block is masked by them, and a block no query may see is skipped."""

    @staticmethod
    def forward(ctx, q, k, v, group: ProcessGroup, layout: ContextLayout,
                documents: Documents | None = None):
        with torch.autocast(q.device.type, enabled=False):
            g, scale = q.shape[2] // k.shape[2], q.shape[-1] ** -0.5
            qh = q.transpose(1, 2)  # (b, heads, s, d)
            out = torch.zeros(qh.shape, dtype=torch.float32, device=q.device)
            lse = torch.full(qh.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
            kv = torch.stack((k, v))  # the message: keys and values of the kv heads only
            for step, (src, qs, ks, causal) in enumerate(ring_blocks(*_ring(layout, q))):
                last = step == layout.size - 1
                if not last:  # the next block's transfer, in flight during this one's compute
                    nxt = torch.empty_like(kv)
                    pending = shift(kv, nxt, group, async_op=True)
                mask = _block_mask(documents, layout, src, qs, ks, q.shape[1])
                if _sees_any(mask):
                    o, s = _block(qh[:, :, qs], _heads(kv, 0, g, ks), _heads(kv, 1, g, ks),
                                  causal, scale, mask)
                    out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o, s)
                if not last:
                    pending.wait()
                    kv = nxt
            out = out.transpose(1, 2).contiguous().to(q.dtype)  # (b, s, heads, d)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.documents = group, layout, documents
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        layout = ctx.layout
        with torch.autocast(q.device.type, enabled=False):
            kvh, scale = k.shape[2], q.shape[-1] ** -0.5
            g = q.shape[2] // kvh
            qh, oh, dout = q.transpose(1, 2), out.transpose(1, 2), grad.transpose(1, 2)
            dq = torch.zeros(qh.shape, dtype=torch.float32, device=q.device)
            kv = torch.stack((k, v))
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # travels with kv
            for step, (src, qs, ks, causal) in enumerate(ring_blocks(*_ring(layout, q))):
                last = step == layout.size - 1
                if not last:
                    nxt = torch.empty_like(kv)
                    pending = shift(kv, nxt, ctx.group, async_op=True)
                mask = _block_mask(ctx.documents, layout, src, qs, ks, q.shape[1])
                if _sees_any(mask):
                    kb, vb = (_heads(kv, i, g, ks).contiguous() for i in (0, 1))
                    dq_, dk, dv = _block_backward(
                        dout[:, :, qs].contiguous(), qh[:, :, qs].contiguous(), kb, vb,
                        oh[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), causal, scale,
                        mask)
                    dq[:, :, qs] += dq_
                    dkv[0][:, ks] += _kv_grad(dk, kvh)
                    dkv[1][:, ks] += _kv_grad(dv, kvh)
                # The block's gradient goes on with the block: the next rank works on it next.
                arrived = torch.empty_like(dkv)
                shift(dkv, arrived, ctx.group, tag=1)
                dkv = arrived
                if not last:
                    pending.wait()
                    kv = nxt
            # After C shifts each block's gradient, summed over every rank's queries, is home.
            dq = dq.transpose(1, 2).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _ring(layout: ContextLayout, q: torch.Tensor) -> tuple[int, int, int]:
    return layout.rank, layout.size, q.shape[1]


def _sees_any(mask: torch.Tensor | None) -> bool:
    """Whether a block has a score to compute: unmasked, or a query that sees one of its keys
    (a traced step's fake mask has no values: computed, as the shapes need)."""
    return mask is None or is_fake(mask) or bool(mask.any())


def _block_mask(documents: Documents | None, layout: ContextLayout, src: int, qs: slice,
                ks: slice, local_len: int) -> torch.Tensor | None:
    """The documents' mask of one ring block: this rank's queries `qs` against the keys `ks` of
    rank `src`'s block, by their positions in the window (None without documents)."""
    if documents is None:
        return None
    keys = layout.index(local_len * layout.size, documents.ids.device, rank=src)[ks]
    return documents.mask(documents.index[qs], keys)


class RingAttentionKernel(nn.Module):
    """The attention kernel under ring context parallelism: (q, k, v) of this rank's tokens ->
    their attention over the whole sequence."""

    def __init__(self, cp: Axis, layout: ContextLayout):
        super().__init__()
        self.group, self.layout = cp.group, layout

    @torch.compiler.disable  # the ring's sends: eager between compiled pieces (compile.py)
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        return RingAttention.apply(q, k, v, self.group, self.layout, documents)


class UlyssesAttentionKernel(nn.Module):
    """The attention kernel under Ulysses context parallelism."""

    def __init__(self, cp: Axis):
        super().__init__()
        self.group, self.size = cp.group, cp.size

    @torch.compiler.disable  # the all-to-alls: eager between compiled pieces (compile.py)
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        if k.shape[2] % self.size:  # too few key/value heads to split: one per query head
            group = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        q, k, v = (seq_to_heads(t, self.group) for t in (q, k, v))
        # After the all-to-all each rank holds the whole window (of some heads), in order.
        mask = None if documents is None else documents.additive(q.dtype, whole=True)
        return heads_to_seq(causal_attention(q, k, v, mask), self.group)


def apply_cp(chunk: nn.Module, cp: Axis, method: str) -> ContextLayout:
    """Make a model or pipeline chunk attend across the sequence shards of the cp ranks, in place;
    returns the layout of this rank's shard (the trainer cuts the data by it)."""
    if method not in CP_METHODS:
        raise ValueError(f"cp_method is one of {', '.join(CP_METHODS)}, got {method!r}")
    layout = ContextLayout(method, cp.rank, cp.size)
    if cp.size == 1:
        return layout
    plan = needs_plan(chunk, f"parallel.cp={cp.size}")
    if plan.attention_core is None or plan.positions is None:
        raise ValueError(f"context parallelism needs the {plan.family} plan's attention_core "
                         "and positions")
    setattr(chunk, plan.positions, layout.positions)
    parent, _, leaf = plan.attention_core.rpartition(".")
    for block in chunk.get_submodule(plan.blocks).values():
        kernel = RingAttentionKernel(cp, layout) if method == "ring" else \
            UlyssesAttentionKernel(cp)
        setattr(block.get_submodule(parent) if parent else block, leaf, kernel)
    return layout
