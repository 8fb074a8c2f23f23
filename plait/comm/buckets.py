"""Gradient buckets: which parameters share a flat buffer (`plait.parallel.engines.flat.FlatParam`)
of about `cap_bytes`, so that many small gradients travel in a few large messages (latency is paid
per message).

Parameters go in reverse registration order, roughly the order backward produces their gradients,
so the first bucket fills first and its all-reduce can start while backward goes on (Li et al.
2020, "PyTorch Distributed", section 3.2.3). The first bucket is capped smaller (1 MiB by default,
as in torch's DDP) so that communication starts early in backward even when the whole model would
fit in one bucket.
"""

from __future__ import annotations

from torch import nn


def assign_buckets(
    named_params: list[tuple[str, nn.Parameter]], cap_bytes: int, first_cap_bytes: int | None = None
) -> list[list[tuple[str, nn.Parameter]]]:
    """Greedy, in reverse order: a bucket is closed when the next parameter would take it past its
    cap (`first_cap_bytes` for the first bucket, `cap_bytes` after) or has another dtype. A
    parameter larger than the cap gets a bucket of its own."""
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    size = 0
    for name, p in reversed(named_params):
        nbytes = p.numel() * p.element_size()
        cap = first_cap_bytes if len(buckets) == 1 and first_cap_bytes is not None else cap_bytes
        if buckets and size + nbytes <= cap and buckets[-1][-1][1].dtype == p.dtype:
            buckets[-1].append((name, p))
            size += nbytes
        else:
            buckets.append([(name, p)])
            size = nbytes
    return buckets
