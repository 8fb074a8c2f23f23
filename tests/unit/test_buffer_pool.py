"""The buffer pool (plait/parallel/engines/buffer_pool.py): a storage's memory comes and goes under
the views of it, reused rather than allocated again, and never more buffers than were in use at
once."""

import pytest
import torch

from plait.parallel.engines.buffer_pool import SMALLEST, SWAPS, BufferPool

N = SMALLEST // 4  # fp32 elements of a buffer the pool serves


def _empty(numel: int) -> torch.Tensor:
    t = torch.zeros(numel)
    t.untyped_storage().resize_(0)
    return t


@pytest.mark.skipif(not SWAPS, reason="a torch without UntypedStorage._swap_data_ptr_ (2.11): "
                    "the pool leaves every buffer to the allocator")
def test_views_see_the_memory_attached_under_them_and_it_is_reused():
    pool = BufferPool()
    unit = torch.zeros(N)
    view = unit[5:9]  # what a parameter (or autograd's saved transpose of it) holds
    unit.untyped_storage().resize_(0)  # as ZeRO-3 frees a unit: the views stay
    pool.attach(unit.untyped_storage(), N * 4)
    unit.fill_(3.0)
    assert torch.equal(view, torch.full((4,), 3.0))
    first = unit.data_ptr()
    pool.detach(unit.untyped_storage())
    assert unit.untyped_storage().nbytes() == 0
    other = _empty(N)
    pool.attach(other.untyped_storage(), N * 4)  # the first buffer, handed on
    pool.detach(other.untyped_storage())
    pool.attach(unit.untyped_storage(), N * 4)
    assert unit.data_ptr() == first and torch.equal(view, torch.full((4,), 3.0))


@pytest.mark.skipif(not SWAPS, reason="a torch without UntypedStorage._swap_data_ptr_ (2.11): "
                    "the pool leaves every buffer to the allocator")
def test_no_more_buffers_than_were_attached_at_once():
    pool = BufferPool()
    a, b, c = _empty(N), _empty(N), _empty(2 * N)
    for t in (a, b):
        pool.attach(t.untyped_storage(), t.numel() * 4)
    for t in (a, b):
        pool.detach(t.untyped_storage())
    assert pool.idle_bytes == 2 * N * 4  # two in use at once: two kept
    pool.attach(c.untyped_storage(), 2 * N * 4)  # neither fits: one is let go for a new one
    pool.detach(c.untyped_storage())
    assert pool.idle_bytes == 3 * N * 4
    pool.attach(a.untyped_storage(), N * 4)  # the smallest that fits
    assert pool.idle_bytes == 2 * N * 4
    pool.release_idle()
    assert pool.idle_bytes == 0


def test_small_buffers_and_staging():
    pool = BufferPool()
    small = _empty(16)
    pool.attach(small.untyped_storage(), 64)  # left to the allocator
    pool.detach(small.untyped_storage())
    assert pool.idle_bytes == 0
    staging = pool.zeros(N, torch.float32, torch.device("cpu"))
    staging.fill_(1.0)
    pool.detach(staging.untyped_storage())
    again = pool.zeros(N, torch.float32, torch.device("cpu"))
    assert torch.equal(again, torch.zeros(N))  # reused, and zeroed
