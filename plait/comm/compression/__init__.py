"""Gradient compression: communication algorithms for the data-parallel gradient reduction.

A method is not a filter around one all-reduce: it chooses its own collectives and keeps its own
state. Each takes one flat gradient buffer of a data-parallel engine (a DDP bucket, or a ZeRO flat
parameter padded to a multiple of the group) holding this rank's gradient already divided by the
group size n, so that sums over the ranks are means, and offers the two reductions the engines
need:

    all_reduce(key, flat, segments, group)            DDP: `flat` <- the (approximate) mean
    reduce_scatter(key, flat, out, segments, group)   ZeRO-1/2/3: `out` <- this rank's 1/n of it

Both start the first collective asynchronously and return a `Chain`; `wait()` finishes it and runs
what follows (decoding, a second collective). The engines launch buckets in index order and wait
in index order on every rank, so the collectives of all ranks line up one by one: the order is
deterministic, which is what PyTorch's PowerSGD hook lacks on gloo.

`segments` say which parameter occupies which elements of the buffer (`Segment`): per-tensor
methods (top-k, sign, PowerSGD) work tensor by tensor, so their result does not depend on how
parameters were bucketed. `key` names the buffer, for the state kept between steps.

| method   | file          | collectives per buffer                          | state           |
|----------|---------------|-------------------------------------------------|-----------------|
| fp16/bf16| `cast.py`     | the all-reduce / reduce-scatter in 2 bytes      | none            |
| int8     | `int8.py`     | all-to-all of int8 + block scales (+ all-gather)| none            |
| topk     | `topk.py`     | all-gather of values and indices                | error feedback  |
| powersgd | `powersgd.py` | two all-reduces (P, then Q)                     | error, Q        |
| sign     | `sign.py`     | all-gather of packed sign bits + scales         | error feedback  |

Each method also states its traffic as a formula (`messages`) and its state size
(`state_numel`), which `plait.predict.cost` uses and the tests assert against the ledger. What
every method shares (segments, chains, the protocol, `Compression`) is in `base.py`.
"""

from __future__ import annotations

import torch

from plait.comm.compression import cast, int8, powersgd, sign, topk
from plait.comm.compression.base import (
    Chain,
    Compression,
    GatheredWithFeedback,
    Method,
    Segment,
    all_gather_sum,
    layout,
    members_numel,
    own_chunk,
    replica_segment,
    sum_in_rank_order,
)


def build_compression(method: str, ratio: float = 0.01, rank: int = 4,
                      start: int = 0) -> Compression | None:
    """`parallel.compression` and its options (`ratio` for top-k, `rank` for PowerSGD); None for
    "none": the engine's own uncompressed reduction."""
    if method == "none":
        return None
    build = {
        "fp16": lambda: cast.Cast(torch.float16),
        "bf16": lambda: cast.Cast(torch.bfloat16),
        "int8": int8.Int8,
        "topk": lambda: topk.TopK(ratio),
        "powersgd": lambda: powersgd.PowerSGD(rank),
        "sign": sign.Sign,
    }[method]
    return Compression(build(), start)


__all__ = ["Chain", "Compression", "GatheredWithFeedback",
           "Method", "Segment", "all_gather_sum", "build_compression", "layout", "members_numel",
           "own_chunk", "replica_segment", "sum_in_rank_order"]
