"""Gradient compression simulated in one process: n ranks' gradients in, the result every rank
should get out, written plainly from the papers (loops over ranks, blocks and tensors), without
plait's packing into messages. The distributed methods are compared with it on the gradients the
ranks actually had (tests/dist/test_compression.py).

Each buffer holds a rank's gradient / n (so sums are means), laid out as `segments` say; for ZeRO
the buffer is padded to a multiple of n and each rank keeps its 1/n of the result.
"""

from __future__ import annotations

import math
import zlib

import torch

INT8_BLOCK = 256


def _rank_order_sum(parts):
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def _int8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Blocks of 256 from the start of x, each sent as round(x / s), s = max|x| / 127."""
    out = torch.zeros_like(x)
    for start in range(0, x.numel(), INT8_BLOCK):
        block = x[start : start + INT8_BLOCK]
        scale = block.abs().max() / 127
        if scale > 0:
            out[start : start + INT8_BLOCK] = torch.round(block / scale).clamp(-127, 127) * scale
    return out


class Simulation:
    def __init__(self, method: str, n: int, ratio: float = 0.01, rank: int = 4):
        self.method, self.n, self.ratio, self.rank = method, n, ratio, rank
        self.error: dict = {}  # (rank, key or tensor name) -> what was not sent
        self.q: dict[str, torch.Tensor] = {}

    def reduce(self, key: str, inputs: list[torch.Tensor], segments, sharded: bool):
        """The full result (for ZeRO: every rank keeps its slice of it)."""
        inputs = [x.float() for x in inputs]
        return getattr(self, self.method)(key, inputs, segments, sharded)

    def fp16(self, key, inputs, segments, sharded):
        return _rank_order_sum([x.half().float() for x in inputs])

    def bf16(self, key, inputs, segments, sharded):
        return _rank_order_sum([x.bfloat16().float() for x in inputs])

    def int8(self, key, inputs, segments, sharded):
        numel, n = inputs[0].numel(), self.n
        c = math.ceil(numel / n)
        padded = [torch.cat([x, x.new_zeros(n * c - numel)]) for x in inputs]
        chunks = []
        for j in range(n):  # chunk j is reduced by rank j from every rank's quantised chunk j
            chunk = _rank_order_sum([_int8_roundtrip(x[j * c : (j + 1) * c]) for x in padded])
            chunks.append(chunk if sharded else _int8_roundtrip(chunk))  # all-reduce: again
        return torch.cat(chunks)[:numel]

    def _with_error(self, r, key, x):
        return x + self.error.get((r, key), torch.zeros_like(x))

    def topk(self, key, inputs, segments, sharded):
        sent_by_rank = []
        for r, x in enumerate(inputs):
            m = self._with_error(r, key, x)
            sent = torch.zeros_like(m)
            for s in segments:
                part = m[s.offset : s.offset + math.prod(s.shape)]
                k = max(1, math.ceil(self.ratio * part.numel()))
                top = torch.topk(part.abs(), k, sorted=False).indices + s.offset
                sent[top] = m[top]
            self.error[(r, key)] = m - sent
            sent_by_rank.append(sent)
        return _rank_order_sum(sent_by_rank)

    def sign(self, key, inputs, segments, sharded):
        sent_by_rank = []
        for r, x in enumerate(inputs):
            m = self._with_error(r, key, x)
            sent = torch.zeros_like(m)
            for s in segments:
                part = slice(s.offset, s.offset + math.prod(s.shape))
                scale = m[part].abs().mean()
                sent[part] = torch.where(m[part] >= 0, scale, -scale)
            self.error[(r, key)] = m - sent
            sent_by_rank.append(sent)
        return _rank_order_sum(sent_by_rank)

    def powersgd(self, key, inputs, segments, sharded):
        result = torch.zeros_like(inputs[0])
        for s in segments:
            part = slice(s.offset, s.offset + math.prod(s.shape))
            rows = s.shape[0]
            cols = math.prod(s.shape) // rows
            r = min(self.rank, rows, cols)
            if len(s.shape) < 2 or r * (rows + cols) >= rows * cols:  # sent whole
                result[part] = _rank_order_sum([x[part] for x in inputs])
                continue
            if s.name not in self.q:
                g = torch.Generator().manual_seed(zlib.crc32(s.name.encode()))
                self.q[s.name] = torch.randn(cols, r, generator=g)
            ms = [self._with_error(i, s.name, x[part].view(rows, cols))
                  for i, x in enumerate(inputs)]
            p = torch.linalg.qr(_rank_order_sum([m @ self.q[s.name] for m in ms])).Q
            q = _rank_order_sum([m.T @ p for m in ms])
            self.q[s.name] = q
            for i, m in enumerate(ms):  # each rank keeps what its own M lost to the projection
                self.error[(i, s.name)] = m - p @ p.T @ m
            result[part] = (p @ q.T).reshape(-1)
        return result
