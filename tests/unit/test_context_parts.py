"""The parts of context parallelism that need no process group: the blockwise softmax merge of
ring attention against full attention, the causal load balance of its chunk layout, and the
layouts' cutting of a sequence."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.parallel.context_parallel import ContextLayout, attend_block, merge, ring_blocks


def full_attention(q, k, v, mask):
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1) @ v


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), cuts=st.lists(st.integers(1, 23), max_size=4, unique=True))
def test_merged_blocks_equal_full_attention(seed, cuts):
    """Keys cut into blocks at random points, each block attended alone under the causal mask
    and merged by log-sum-exp in a shuffled order, give full causal attention. Blocks of keys
    after every query of a row are fully masked for it (lse -inf): merging them must change
    nothing, and a block masked for every query too. (float64: the check is of the algebra.)"""
    g = torch.Generator().manual_seed(seed)
    s, d = 24, 8
    q, k, v = (torch.randn(2, 3, s, d, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    edges = [0, *sorted(cuts), s]
    blocks = [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]
    order = torch.randperm(len(blocks), generator=g).tolist()
    out = torch.zeros(2, 3, s, d, dtype=torch.float64)
    lse = torch.full((2, 3, s), -math.inf, dtype=torch.float64)
    for i in order:
        a, b = blocks[i]
        o, l_ = attend_block(q, k[..., a:b, :], v[..., a:b, :], d**-0.5, mask[:, a:b])
        out, lse = merge(out, lse, o, l_)
    # A block no query may see: out 0, lse -inf everywhere; merging it is a no-op.
    o, l_ = attend_block(q, k, v, d**-0.5, torch.zeros(s, s, dtype=torch.bool))
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(l_).all()
    out2, lse2 = merge(out, lse, o, l_)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    assert not out.isnan().any()
    torch.testing.assert_close(out, full_attention(q, k, v, mask), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ((q @ k.transpose(-1, -2)) * d**-0.5).masked_fill(
        ~mask, -math.inf).logsumexp(-1))


def test_merging_nothing_into_nothing_stays_empty():
    """Two empty partials (a query that has seen no key yet): lse -inf, out 0, no nan."""
    out, lse = merge(torch.zeros(1, 2, 4), torch.full((1, 2), -math.inf),
                     torch.zeros(1, 2, 4), torch.full((1, 2), -math.inf))
    assert torch.equal(out, torch.zeros(1, 2, 4)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("C", [1, 2, 3, 4, 8])
def test_ring_work_is_balanced_and_covers_the_causal_mask_once(C):
    """Per rank: the chunk pairs it computes and the unmasked scores among them are the same on
    every rank (the load balance of chunks i and 2C-1-i), and over all ranks the unmasked
    (query, key) pairs computed are exactly the causal ones, each once."""
    c = 3  # tokens per chunk
    S = 2 * C * c
    seen = torch.zeros(S, S, dtype=torch.int64)
    blocks, scores = [], []
    for rank in range(C):
        layout = ContextLayout("ring", rank, C)
        q_pos = layout.index(S)
        n_blocks = n_scores = 0
        for src, qs, ks, causal in ring_blocks(rank, C, 2 * c):
            k_pos = ContextLayout("ring", src, C).index(S)
            qp, kp = q_pos[qs], k_pos[ks]
            visible = qp[:, None] >= kp[None, :]
            if not causal:  # a block computed without a mask must need none
                assert visible.all(), (rank, src)
            n_blocks += len(qp) // c * (len(kp) // c)
            n_scores += int(visible.sum())
            rows, cols = qp[:, None].expand_as(visible), kp[None, :].expand_as(visible)
            seen[rows[visible], cols[visible]] += 1
        blocks.append(n_blocks)
        scores.append(n_scores)
    assert len(set(blocks)) == 1 and blocks[0] == 4 + 2 * (C - 1)
    assert len(set(scores)) == 1 and scores[0] * C == S * (S + 1) // 2
    assert torch.equal(seen, torch.ones(S, S, dtype=torch.int64).tril())


def test_contiguous_shards_would_not_be_balanced():
    """Why the ring uses chunks i and 2C-1-i: with contiguous shards the last rank's queries see
    about 2C - 1 times the keys of the first rank's (here 6.3 times)."""
    C, s = 4, 8
    work = [sum(1 for qp in range(r * s, (r + 1) * s) for kp in range(qp + 1)) for r in range(C)]
    assert work[-1] > 5 * work[0]


@pytest.mark.parametrize("method,C", [("ring", 2), ("ring", 4), ("ulysses", 2), ("ulysses", 4)])
def test_layouts_partition_the_sequence(method, C):
    S = 16
    index = [ContextLayout(method, r, C).index(S) for r in range(C)]
    assert torch.equal(torch.cat(index).sort().values, torch.arange(S))
    if method == "ring":
        assert index[0].tolist() == [*range(S // (2 * C)), *range(S - S // (2 * C), S)]
    else:
        assert index[1].tolist() == list(range(S // C, 2 * S // C))
    x = torch.arange(2 * S).view(2, S)
    layout = ContextLayout(method, C - 1, C)
    assert torch.equal(layout.shard(x), x[:, index[-1]])
    assert torch.equal(layout.positions(S // C, None), index[-1])


def test_fused_and_math_blocks_agree_under_a_document_mask(monkeypatch):
    """The ring's block kernel and its backward under a document mask: torch's fused CPU kernel
    (given the mask as -inf, its log-sum-exp mended where a query sees no key of the block)
    equals the plain math, including rows the mask hides whole, and merging both halves of the
    keys gives full masked attention. fp32: 1e-5 (two summation orders)."""
    from plait.model.documents import Documents
    from plait.parallel import context_parallel as cp

    g = torch.Generator().manual_seed(0)
    s, d = 16, 8
    q, k, v, dout = (torch.randn(2, 4, s, d, generator=g) for _ in range(4))
    ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    mask = Documents.whole(ids).mask()  # (2, 1, 16, 16)
    halves = [(slice(0, 8), slice(0, 8)), (slice(8, 16), slice(0, 8)),
              (slice(8, 16), slice(8, 16))]  # query rows x key rows, the later keys all masked
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(cp, "FUSED_CPU", fused)
        out = torch.zeros(2, 4, s, d)
        lse = torch.full((2, 4, s), -math.inf)
        for qs, ks in halves:
            o, l_ = cp._block(q[:, :, qs], k[:, :, ks], v[:, :, ks], False, d**-0.5,
                              mask[:, :, qs, ks])
            out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o, l_)
        grads = [cp._block_backward(dout[:, :, qs].contiguous(), q[:, :, qs].contiguous(),
                                    k[:, :, ks].contiguous(), v[:, :, ks].contiguous(),
                                    out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(),
                                    False, d**-0.5, mask[:, :, qs, ks]) for qs, ks in halves]
        results[fused] = out, lse, [t for block in grads for t in block]
    (out, lse, grads), (math_out, math_lse, math_grads) = results[True], results[False]
    torch.testing.assert_close(out, full_attention(q, k, v, mask), rtol=0, atol=1e-5)
    torch.testing.assert_close(out, math_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, math_lse, rtol=0, atol=1e-5)
    for a, b in zip(grads, math_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
