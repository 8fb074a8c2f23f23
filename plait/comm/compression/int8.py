"""int8: each value in one byte, with an fp32 scale per block of 256 (block-wise quantisation as
in ZeRO++'s qgZ, Wang et al. 2023, section 3.3). A block x is sent as round(x / s) with
s = max|x| / 127, and read back as q * s: the error of an element is at most s / 2.

Integers cannot be summed by the reduction collectives without overflow or loss of the scales, so
the reduction is written as an exchange (two-phase, as qgZ's all-to-all):

    1. all-to-all: chunk j of this rank's buffer, quantised, goes to rank j; rank j dequantises the
       n chunks it receives and sums them in rank order: its 1/n of the mean (a reduce-scatter,
       which is all ZeRO needs);
    2. (all-reduce only) each rank quantises its reduced chunk again and all-gathers them.

Per rank, for a buffer of D elements (c = D / n per chunk, b = c / 256 blocks): phase 1 moves
(n - 1)(c + 4b) bytes, phase 2 as much again: about a quarter of the fp32 ring all-reduce's
2 (n - 1) / n * 4D. No state: what quantisation loses is not fed back.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from plait.comm.collectives import Op, all_gather, all_to_all
from plait.comm.compression.base import Chain, Segment, sum_in_rank_order

BLOCK = 256


def blocks(c: int) -> int:
    return -(-c // BLOCK)


def packed_len(c: int) -> int:
    """Bytes of one quantised chunk of c elements: the int8 values, then the fp32 block scales."""
    return c + 4 * blocks(c)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """(m, c) floats -> (m, packed_len(c)) bytes."""
    m, c = x.shape
    nb = blocks(c)
    padded = torch.zeros(m, nb * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :c] = x
    padded = padded.view(m, nb, BLOCK)
    scale = padded.abs().amax(dim=-1) / 127  # (m, nb)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q.view(m, -1)[:, :c].view(torch.uint8), scale.view(torch.uint8)], dim=1)


def dequantize(packed: torch.Tensor, c: int) -> torch.Tensor:
    """(m, packed_len(c)) bytes -> (m, c) fp32."""
    m, nb = packed.shape[0], blocks(c)
    q = packed[:, :c].contiguous().view(torch.int8).float()
    scale = packed[:, c:].clone().view(torch.float32)  # (m, nb); a copy: aligned for the view
    padded = torch.zeros(m, nb * BLOCK, device=packed.device)
    padded[:, :c] = q
    return (padded.view(m, nb, BLOCK) * scale[..., None]).view(m, -1)[:, :c]


class Int8:
    def _exchange(self, chunks: torch.Tensor, group: ProcessGroup):
        """Phase 1, started: (n, c) chunks out, quantised; returns (pending, received bytes)."""
        send = quantize(chunks)
        received = torch.empty_like(send)
        return all_to_all(received, send, group, async_op=True), received

    def all_reduce(self, key: str, flat: torch.Tensor, segments: list[Segment],
                   group: ProcessGroup) -> Chain:
        n, total = group.size(), flat.numel()
        c = -(-total // n)
        padded = torch.zeros(n * c, dtype=torch.float32, device=flat.device)
        padded[:total] = flat
        pending, received = self._exchange(padded.view(n, c), group)

        def then() -> None:
            mine = sum_in_rank_order(dequantize(received, c))
            gathered = torch.empty(n * packed_len(c), dtype=torch.uint8, device=flat.device)
            all_gather(gathered, quantize(mine[None]).view(-1), group)
            flat.copy_(dequantize(gathered.view(n, -1), c).reshape(-1)[:total])

        return Chain(pending, then)

    def reduce_scatter(self, key: str, flat: torch.Tensor, out: torch.Tensor,
                       segments: list[Segment], group: ProcessGroup) -> Chain:
        n, c = group.size(), out.numel()
        pending, received = self._exchange(flat.float().view(n, c), group)
        return Chain(pending, lambda: out.copy_(sum_in_rank_order(dequantize(received, c))))

    def messages(self, segments, numel: int, n: int, sharded: bool) -> list[tuple[Op, int]]:
        wire = n * packed_len(-(-numel // n))
        return [(Op.ALL_TO_ALL, wire)] + ([] if sharded else [(Op.ALL_GATHER, wire)])

    def state_numel(self, segments, numel: int) -> int:
        return 0

    def state_bytes(self) -> int:
        return 0

    def state_tensors(self, key, segments, numel: int, device) -> dict:
        return {}
