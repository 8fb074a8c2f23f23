"""1-bit: scaled sign with error feedback (Seide et al. 2014, "1-Bit Stochastic Gradient
Descent"; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD", the compressor
C(M) = mean|M| * sign(M) per tensor, as in 1-bit Adam's compressed communication). Each rank sends
one bit per element and one fp32 scale per tensor of M = g + e, and keeps e <- M - C(M).

Bits do not sum, so the messages (the bits packed eight to a byte, then the scales) are
all-gathered and every rank decodes and adds the n of them in rank order. Per rank:
(n - 1) * (ceil(D / 8) + 4T) bytes for D elements in T tensors, about (n - 1) D / 8 against the
fp32 all-reduce's 2 (n - 1) / n * 4D. Under ZeRO each rank keeps its slice of the result.

State: one fp32 error buffer of the buffer's size per rank (`GatheredWithFeedback`).
"""

from __future__ import annotations

import torch

from plait.comm.collectives import Op
from plait.comm.compression.base import GatheredWithFeedback, Segment, members_numel


def _bits(device) -> torch.Tensor:
    """2^i for i < 8: bit i of a byte is element i of its eight. Made per call, not once at
    import: a module first imported during a fake-tensor trace (`plait train --dry-run`, the
    planner) would keep a fake tensor for the real run."""
    return 2 ** torch.arange(8, dtype=torch.uint8, device=device)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(D,) bool -> (ceil(D / 8),) uint8."""
    padded = torch.zeros(-(-bits.numel() // 8) * 8, dtype=torch.uint8, device=bits.device)
    padded[: bits.numel()] = bits
    return (padded.view(-1, 8) * _bits(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """(ceil(D / 8),) uint8 -> (D,) bool."""
    return (packed[:, None] & _bits(packed.device)).ne(0).view(-1)[:count]


class Sign(GatheredWithFeedback):
    def encode(self, m: torch.Tensor, segments: list[Segment]):
        """Packed bits then the fp32 scales; and the scale * sign values they stand for."""
        total = members_numel(segments)
        bits = m[:total] >= 0
        scales = torch.stack([s.of(m).abs().mean() for s in segments])
        carried = torch.zeros_like(m)
        carried[:total] = self._values(bits, scales, segments)
        return torch.cat([pack_bits(bits), scales.view(torch.uint8)]), carried

    def decode(self, message: torch.Tensor, numel: int, segments) -> torch.Tensor:
        total = members_numel(segments)
        nbits = -(-total // 8)
        scales = message[nbits:].clone().view(torch.float32)  # a copy: aligned for the view
        dense = torch.zeros(numel, dtype=torch.float32, device=message.device)
        dense[:total] = self._values(unpack_bits(message[:nbits], total), scales, segments)
        return dense

    @staticmethod
    def _values(bits, scales, segments) -> torch.Tensor:
        """scale of its tensor * (+1 | -1) per element."""
        signs = bits.float() * 2 - 1
        return signs * torch.repeat_interleave(scales, torch.tensor([s.numel for s in segments],
                                                                    device=bits.device))

    def messages(self, segments, numel: int, n: int, sharded: bool) -> list[tuple[Op, int]]:
        return [(Op.ALL_GATHER, n * (-(-members_numel(segments) // 8) + 4 * len(segments)))]
