import torch
from torch import nn

from plait.comm.buckets import assign_buckets
from plait.model import PRESETS, build_model
from plait.parallel.engines.flat import FlatParam


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


def test_buckets_partition_the_model_and_parameters_live_in_their_flat_buffer():
    model = build_model(PRESETS["tiny"], seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = assign_buckets(list(model.named_parameters()), cap_bytes=64 * 1024)
    names = [n for b in groups for n, _ in b]
    assert names == [n for n, _ in reversed(list(model.named_parameters()))]
    for members in groups:
        flat = FlatParam(members, None, 1, 0)
        assert flat.full_bytes <= 64 * 1024 or len(flat.params) == 1
        for i, p in enumerate(flat.params):
            assert p.data_ptr() == flat.full[flat.offsets[i]:].data_ptr()
            assert torch.equal(p, before[flat.names[i]])  # moved in, values kept
    # Each closed bucket was full: the next parameter would not have fitted.
    for b, nxt in zip(groups, groups[1:], strict=False):
        assert sum(p.numel() * 4 for _, p in b) + nxt[0][1].numel() * 4 > 64 * 1024


def test_flat_shards_pad_to_a_multiple_of_the_group_and_pieces_cover_each_parameter():
    named = _params(5, 3)
    flat = FlatParam(named, True, 4, 1)  # 8 elements, 4 ranks: slices of 2, rank 1 holds [2, 4)
    assert flat.shard_numel == 2 and flat.full.numel() == 8
    flat.grad_shard = torch.tensor([1.0, 2.0])
    assert [(n, t.tolist()) for n, t in flat.grad_pieces()] == [("p0", [1.0, 2.0])]
    flat.rank = 2  # [4, 6): the last element of p0 and the first of p1
    assert [(n, t.tolist()) for n, t in flat.grad_pieces()] == [("p0", [1.0]), ("p1", [2.0])]
