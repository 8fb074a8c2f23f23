"""The compression methods' parts on known answers, and error feedback: what one step does not
send is sent later."""

from __future__ import annotations

import torch
import torch.distributed as dist
from harness import run_world
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.comm.compression import Segment, build_compression, layout
from plait.comm.compression.int8 import BLOCK, dequantize, packed_len, quantize
from plait.comm.compression.powersgd import compressed_rank
from plait.comm.compression.sign import pack_bits, unpack_bits


def test_int8_error_is_at_most_half_a_step_per_block():
    x = torch.randn(3, 1000) * torch.logspace(-6, 2, 1000)  # blocks of very different scales
    packed = quantize(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, packed_len(1000))
    assert packed_len(1000) == 1000 + 4 * 4  # 4 blocks of 256, one fp32 scale each
    back = dequantize(packed, 1000)
    for start in range(0, 1000, BLOCK):
        block, err = x[:, start : start + BLOCK], (back - x)[:, start : start + BLOCK]
        step = block.abs().amax(dim=1, keepdim=True) / 127
        assert (err.abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(dequantize(quantize(torch.zeros(1, 300)), 300), torch.zeros(1, 300))
    exact = torch.tensor([[127.0, -127.0, 0.0, 1.0]])  # on the grid of step 1: exact
    assert torch.equal(dequantize(quantize(exact), 4), exact)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=100))
def test_sign_bits_pack_eight_to_a_byte(bits):
    t = torch.tensor(bits)
    packed = pack_bits(t)
    assert packed.numel() == -(-len(bits) // 8)
    assert torch.equal(unpack_bits(packed, len(bits)), t)


def test_powersgd_compresses_only_where_it_pays():
    assert compressed_rank((64, 64), 4) == 4  # 4 * 128 < 4096
    assert compressed_rank((64,), 4) == 0  # a norm gain: sent whole
    assert compressed_rank((8, 3), 4) == 0  # r = 3: 3 * 11 > 24
    assert compressed_rank((16, 4, 4), 2) == 2  # seen as 16 x 16


def _reduce_alone(method_name, gradients, shape, **options):
    """One rank reducing a (shape) parameter's gradient each step: what it sends (the result,
    as the group of one is the whole group), and the method."""
    compression = build_compression(method_name, **options)
    segments = [Segment("w", 0, shape)]
    sent = []
    for g in gradients:
        flat = g.reshape(-1).clone()
        compression.method.all_reduce("w", flat, segments, dist.group.WORLD).wait()
        sent.append(flat.view(shape))
    return sent, compression.method


def _error_feedback(method_name, steps, **options):
    torch.manual_seed(0)
    g = torch.randn(40, 30)  # the same gradient every step
    sent, method = _reduce_alone(method_name, [g] * steps, (40, 30), **options)
    total = torch.stack(sent).double().cumsum(0)
    g, error = g.double(), method.error["w"].view(40, 30).double()
    # Nothing is lost: what was sent plus what is held back is every gradient so far (up to the
    # fp32 rounding of the error buffer, added to once a step).
    torch.testing.assert_close(total[-1] + error, steps * g, rtol=1e-4, atol=1e-3)
    gap = [(total[t - 1] - t * g).norm() / (t * g).norm() for t in (steps // 4, steps)]
    ever_sent = (torch.stack(sent) != 0).any(0)
    return gap, ever_sent, g.abs()


def test_error_feedback_sends_later_what_it_holds_back():
    def run():
        out = {}
        # top-k at 1%: 12 of 1200 elements a step; the rest waits, growing, until it is largest.
        out["topk"] = _error_feedback("topk", 1000, ratio=0.01)
        out["sign"] = _error_feedback("sign", 1000)
        return out

    result = run_world(run, 1)[0]
    for name, (gap, ever_sent, size) in result.items():
        assert gap[1] < gap[0] / 1.5, name  # the sum of what was sent converges to the gradients'
        assert gap[1] < 0.05, name
        # Every element got through at some step, once its held-back sum was among the largest:
        # for top-k, after about sum|g| / k / |g_i| steps (~80 / |g_i| here), so all but the
        # tiniest within the run.
        assert ever_sent[size > 0.2].all(), name
        assert ever_sent.float().mean() > 0.8, name


def test_powersgd_is_exact_on_low_rank_gradients_and_feeds_back_the_rest():
    def run():
        torch.manual_seed(0)
        low = torch.randn(50, 1) @ torch.randn(1, 40)  # rank 1
        sent, _ = _reduce_alone("powersgd", [low], (50, 40), rank=1)
        full = torch.randn(50, 40)
        sent_full, method = _reduce_alone("powersgd", [full] * 200, (50, 40), rank=2)
        error = method.error["w"]
        return low, sent[0], full, torch.stack(sent_full), error

    low, sent, full, sent_full, error = run_world(run, 1)[0]
    torch.testing.assert_close(sent, low, rtol=1e-4, atol=1e-5)  # P P^T M = M on its span
    total = sent_full.double().sum(0)
    torch.testing.assert_close(total + error.double(), 200 * full.double(), rtol=0, atol=1e-3)
    first_gap = (sent_full[0] - full).norm() / full.norm()
    assert first_gap > 0.5  # rank 2 of a random 50 x 40 matrix misses most of it
    assert (total - 200 * full).norm() / (200 * full).norm() < first_gap / 5


def test_layout_lays_tensors_back_to_back():
    segments = layout([("a", torch.empty(2, 3)), ("b", torch.empty(4))])
    assert segments == [Segment("a", 0, (2, 3)), Segment("b", 6, (4,))]
    assert segments[1].of(torch.arange(10)).tolist() == [6, 7, 8, 9]


def test_error_feedback_loses_nothing_across_ranks():
    """Over the ranks of a group, what the mean received plus what every rank still holds back is
    exactly what they put in: sum_t result_t + sum_r e_r = sum_t sum_r g_r,t / n. (A rank that
    subtracted the group's whole approximation from its own share, instead of its own part of
    it, would lose (n - 1) approximations a step.)"""
    def run(method_name, options):
        compression = build_compression(method_name, **options)
        segments = [Segment("w", 0, (24, 20)), Segment("b", 480, (20,))]
        rank, n = dist.get_rank(), dist.get_world_size()
        put_in, got = torch.zeros(500, dtype=torch.float64), torch.zeros(500, dtype=torch.float64)
        for step in range(6):
            g = torch.randn(500, generator=torch.Generator().manual_seed(10 * step + rank)) / n
            put_in += g.double()
            flat = g.clone()
            compression.method.all_reduce("k", flat, segments, dist.group.WORLD).wait()
            got += flat.double()
        errors = compression.method.error
        held = torch.cat([errors["k"]] if "k" in errors else
                         [errors["w"].reshape(-1), torch.zeros(20)]).double()
        summed = torch.stack([put_in, held])
        dist.all_reduce(summed)
        return got, summed[0], summed[1]

    for method, options in (("topk", {"ratio": 0.05}), ("sign", {}), ("powersgd", {"rank": 2})):
        got, put_in, held = run_world(run, 2, method, options)[0]
        torch.testing.assert_close(got + held, put_in, rtol=0, atol=1e-5, msg=method)


def test_error_feedback_follows_the_fp16_loss_scale():
    """When fp16's loss scale changes by a factor the held-back gradient (scaled as the gradients
    were) changes by it too; after an overflow a non-finite error restarts from zero and a
    non-finite PowerSGD Q from its seeded start (made again on next use)."""
    topk = build_compression("topk", ratio=0.5)
    topk.method.error = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([float("inf"), 1.0])}
    topk.rescale(0.5)
    assert topk.method.error["a"].tolist() == [0.5, -1.0]
    assert topk.method.error["b"].tolist() == [0.0, 0.0]
    psgd = build_compression("powersgd", rank=1)
    psgd.method.q = {"w": torch.ones(3, 1), "v": torch.full((3, 1), float("nan"))}
    psgd.rescale(2.0)
    assert list(psgd.method.q) == ["w"]
