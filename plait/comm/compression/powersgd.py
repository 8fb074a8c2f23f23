"""PowerSGD (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", Algorithm 1), with error feedback and warm start.

Each parameter's gradient is seen as a matrix, rows = shape[0] by cols = the rest. With r =
min(rank, rows, cols), a matrix is compressed when r (rows + cols) < rows * cols; others (norm
gains, small matrices) are sent whole. For a compressed M = g + e (e: what earlier steps did not
send), with Q (cols, r) kept from the last step (first: standard normal, seeded by the parameter's
name, so equal on every rank):

    P = M Q                  all-reduce P (summed: M holds g / n, so sums are means)
    P = orthonormal(P)       the same on every rank (all hold the same sum)
    Q = M^T P                all-reduce Q
    mean ~ P Q^T,   e <- M - P P^T M   (this rank's own loss to the projection)

Two all-reduces per buffer: the first carries every P and the uncompressed tensors, and starts
during backward; the second carries every Q. Per rank 2 (n - 1) / n * 4 * (sum r (rows + cols) +
uncompressed elements) bytes. Under ZeRO each rank keeps its slice of the result.

State: per compressed matrix its error (rows x cols) and Q (cols x r).
"""

from __future__ import annotations

import zlib

import torch
from torch.distributed import ProcessGroup

from plait.comm.collectives import Op, all_reduce
from plait.comm.compression.base import Chain, Segment, own_chunk


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    rows = shape[0] if shape else 1
    return rows, (1 if not shape else int(torch.Size(shape).numel()) // rows)


def compressed_rank(shape: tuple[int, ...], rank: int) -> int:
    """r for a compressed matrix of this shape; 0 when sending it whole is no larger."""
    rows, cols = matrix_shape(shape)
    r = min(rank, rows, cols)
    return r if len(shape) >= 2 and r * (rows + cols) < rows * cols else 0


class PowerSGD:
    def __init__(self, rank: int):
        self.rank = rank
        self.q: dict[str, torch.Tensor] = {}  # by parameter name, (cols, r)
        self.error: dict[str, torch.Tensor] = {}  # by parameter name, (rows, cols)

    def _q(self, s: Segment, r: int, device) -> torch.Tensor:
        if s.name not in self.q:
            seed = zlib.crc32(s.name.encode())
            g = torch.Generator().manual_seed(seed)
            self.q[s.name] = torch.randn(matrix_shape(s.shape)[1], r, generator=g).to(device)
        return self.q[s.name]

    def _reduce(self, flat: torch.Tensor, segments: list[Segment], group: ProcessGroup,
                write) -> Chain:
        low = [(s, compressed_rank(s.shape, self.rank)) for s in segments]
        whole = [s for s, r in low if not r]
        low = [(s, r) for s, r in low if r]
        ms, ps = [], []
        for s, r in low:
            m = s.of(flat).float().view(matrix_shape(s.shape))
            if s.name in self.error:
                m = m + self.error[s.name]
            ms.append(m)
            ps.append(m @ self._q(s, r, flat.device))
        first = torch.cat([p.reshape(-1) for p in ps] + [s.of(flat).float() for s in whole])
        pending = all_reduce(first, group, async_op=True)

        def then() -> None:
            result = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
            offset = 0
            for p in ps:
                p.copy_(first[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            for s in whole:
                s.of(result).copy_(first[offset : offset + s.numel])
                offset += s.numel
            ps[:] = [torch.linalg.qr(p).Q for p in ps]
            qs = [m.T @ p for m, p in zip(ms, ps, strict=True)]  # this rank's, before the sum
            if qs:
                second = torch.cat([q.reshape(-1) for q in qs])
                all_reduce(second, group)
                offset = 0
                for (s, _), m, p, q in zip(low, ms, ps, qs, strict=True):
                    # What this rank's own M lost to the projection on P stays for later:
                    # M - P P^T M (Vogels et al., Algorithm 2); summed over the ranks it is
                    # exactly what the mean lost.
                    self.error[s.name] = m - p @ q.T
                    q.copy_(second[offset : offset + q.numel()].view_as(q))
                    offset += q.numel()
                    self.q[s.name] = q  # warm start
                    s.of(result).copy_((p @ q.T).reshape(-1))
            write(result)

        return Chain(pending, then)

    def all_reduce(self, key: str, flat: torch.Tensor, segments: list[Segment],
                   group: ProcessGroup) -> Chain:
        return self._reduce(flat, segments, group, flat.copy_)

    def reduce_scatter(self, key: str, flat: torch.Tensor, out: torch.Tensor,
                       segments: list[Segment], group: ProcessGroup) -> Chain:
        return self._reduce(flat, segments, group, own_chunk(out, group))

    def messages(self, segments, numel: int, n: int, sharded: bool) -> list[tuple[Op, int]]:
        first = second = 0
        for s in segments:
            r = compressed_rank(s.shape, self.rank)
            rows, cols = matrix_shape(s.shape)
            first += r * rows if r else s.numel
            second += r * cols
        return [(Op.ALL_REDUCE, 4 * first)] + ([(Op.ALL_REDUCE, 4 * second)] if second else [])

    def state_numel(self, segments, numel: int) -> int:
        return sum(s.numel + matrix_shape(s.shape)[1] * r for s in segments
                   if (r := compressed_rank(s.shape, self.rank)))

    def state_bytes(self) -> int:
        tensors = [*self.q.values(), *self.error.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_tensors(self, key, segments: list[Segment], numel: int,
                      device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
        out = {"error": {}, "q": {}}
        for s in segments:
            if r := compressed_rank(s.shape, self.rank):
                error = self.error.setdefault(s.name, torch.zeros(matrix_shape(s.shape),
                                                                  device=device))
                out["error"][s.name] = error.view(s.shape)
                out["q"][s.name] = self._q(s, r, device)
        return out
