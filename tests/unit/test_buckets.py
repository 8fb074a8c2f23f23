import torch
from torch import nn

from plait.comm.buckets import assign_buckets, build_buckets
from plait.model import PRESETS, build_model


def _params(*numels, dtype=torch.float32):
    return [(f"p{i}", nn.Parameter(torch.zeros(n, dtype=dtype))) for i, n in enumerate(numels)]


def test_reverse_order_greedy_under_the_cap():
    # fp32 sizes 400, 400, 400, 40 bytes; cap 800. Reversed: p3 (40) + p2 (400) = 440, adding p1
    # would make 840 > 800, so close; p1 + p0 = 800 fits exactly.
    buckets = assign_buckets(_params(100, 100, 100, 10), cap_bytes=800)
    assert [[n for n, _ in b] for b in buckets] == [["p3", "p2"], ["p1", "p0"]]


def test_oversized_parameter_gets_its_own_bucket_and_dtypes_do_not_mix():
    named = _params(10, 1000, 10) + _params(10, dtype=torch.bfloat16)
    named[-1] = ("p3", named[-1][1])
    buckets = assign_buckets(named, cap_bytes=100)
    assert [[n for n, _ in b] for b in buckets] == [["p3"], ["p2"], ["p1"], ["p0"]]


def test_buckets_partition_the_model_and_views_alias_the_buffer():
    model = build_model(PRESETS["tiny"], seed=0)
    buckets = build_buckets(model, cap_bytes=64 * 1024)
    names = [n for b in buckets for n in b.names]
    assert names == [n for n, _ in reversed(list(model.named_parameters()))]
    for b in buckets:
        assert b.nbytes <= 64 * 1024 or len(b.params) == 1
        for i, p in enumerate(b.params):
            v = b.views[i]
            assert v.shape == p.shape and v.data_ptr() == b.buffer[b.offsets[i]:].data_ptr()
    # Each closed bucket was full: the next parameter would not have fitted.
    for b, nxt in zip(buckets, buckets[1:], strict=False):
        assert b.nbytes + nxt.params[0].numel() * 4 > 64 * 1024
