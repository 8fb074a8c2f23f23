"""Where Muon's matrices are and who orthogonalizes each (`optim/muon.py` moves them): which
parameters are matrices, each matrix's pieces over the data group and tp, its owner, and the
routes of the four all-to-alls. Shapes and names only, no tensors: every rank, and the formulas
(`predict/cost.py`), find the same answers without talking."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from plait.model.plan import has_plan, plan_of


def muon_matrices(model: nn.Module, chunks: nn.ModuleDict) -> frozenset[str]:
    """The parameters a matrix optimizer steps, as Muon's authors and torch's documentation
    split them: the 2-D weights of the repeated blocks (attention and MLP projections, each
    expert's matrices, a router's). The embedding, the output head, norms and biases stay with
    AdamW. A model with no plan has no blocks to name: every 2-D weight of an `nn.Linear`."""
    if has_plan(model):
        prefix = plan_of(model).blocks + "."
        return frozenset(n for n, p in chunks.named_parameters()
                         if p.requires_grad and p.dim() == 2 and n.startswith(prefix))
    return frozenset(f"{m}.{n}" if m else n for chunk in chunks.values()
                     for m, module in chunk.named_modules() if isinstance(module, nn.Linear)
                     for n, p in module.named_parameters(recurse=False)
                     if p.requires_grad and p.dim() == 2)


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> int:
    """FLOPs of torch's quintic Newton-Schulz on a (rows, cols) matrix: per iteration the gram
    matrix X X^T, its square, and that times X, with X the wide orientation (a x b, a <= b).
    A tensor of more dims counts as (its first dim, the rest) (the owners' balance of
    `WholeMatrices`, whose optimizers take any tensor)."""
    a, b = sorted((shape[0], math.prod(shape[1:])))
    return steps * (2 * a * a * b + 2 * a * a * a + 2 * a * a * b)


@dataclass(frozen=True)
class DataGroup:
    """The ranks holding one tp shard of a set of matrices: ZeRO's sharding group (flat slices),
    or DDP's replicas (each holds all)."""

    group: object  # the process group (the formulas: its name)
    size: int
    index: int  # this rank's
    sharded: bool


@dataclass(frozen=True)
class MatrixBuffer:
    """A flat buffer of the data-parallel engine as the exchange sees it (the engine's, or the
    formulas' `predict.state_cost.flat_buffers`)."""

    data: DataGroup
    segments: tuple  # comm.compression.Segment: where each parameter lies in the buffer
    shard_numel: int  # elements of each rank's slice (sharded groups)


@dataclass
class Matrix:
    """One matrix as the layout holds it."""

    name: str
    shape: tuple[int, ...]  # whole (2-D for Muon; any for `WholeMatrices`)
    local_shape: tuple[int, ...]  # the tp shard (= shape when tp does not split it)
    tp_dim: int | None  # the dim tp splits, or None: whole on every tp rank
    data: DataGroup
    offset: int = 0  # in its flat buffer (sharded data groups)
    shard_numel: int = 0  # of that flat buffer's slices
    owner: tuple[int, int] = (0, 0)  # (data index, tp index)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    def part(self, j: int) -> tuple[int, int]:
        """(start, count) of the flattened tp shard that data rank j holds."""
        if not self.data.sharded:
            return 0, self.local_numel
        lo = max(j * self.shard_numel, self.offset)
        hi = min((j + 1) * self.shard_numel, self.offset + self.local_numel)
        return lo - self.offset, max(0, hi - lo)


def plan_matrices(buffers: list[MatrixBuffer], names: frozenset[str], record,
                  tp_size: int) -> list[Matrix]:
    """The matrices `names` in the engine's flat buffers, in their order, each with its owner:
    largest Newton-Schulz first, to the least loaded (data index, tp index) of its data group,
    ties to the lowest; from shapes and names only, so every rank (and the formulas) find the
    same owners."""
    out = []
    for buffer in buffers:
        for segment in buffer.segments:
            if segment.name not in names:
                continue
            place = record.params[segment.name]
            tp = place.shards.get("tp")
            out.append(Matrix(segment.name, place.shape, place.local_shape,
                              tp.dim if tp is not None and tp_size > 1 else None, buffer.data,
                              segment.offset, buffer.shard_numel if buffer.data.sharded else 0))
    for data in dict.fromkeys(m.data for m in out):
        load = {(d, t): 0 for d in range(data.size) for t in range(tp_size)}
        for m in sorted((m for m in out if m.data == data),
                        key=lambda m: (-newton_schulz_flops(m.shape, 1), m.name)):
            m.owner = min(load, key=lambda slot: (load[slot], slot))
            load[m.owner] += newton_schulz_flops(m.shape, 1)
    return out


class Routes:
    """Who sends which pieces to whom in each of the exchange's four all-to-alls, for this rank
    (tp rank `tp_rank` of `tp_size`): what the exchange moves and what the formulas count."""

    def __init__(self, matrices: list[Matrix], tp_rank: int, tp_size: int):
        self.matrices, self.tp_rank, self.tp_size = matrices, tp_rank, tp_size
        self.groups = list(dict.fromkeys(m.data for m in matrices))

    def of(self, data: DataGroup) -> list[Matrix]:
        return [m for m in self.matrices if m.data == data]

    def assembling(self, data: DataGroup | None = None) -> list[Matrix]:
        """The matrices whose tp shard comes together on this rank (of `data`, or all)."""
        return [m for m in self.matrices if m.owner[0] == m.data.index
                and (data is None or m.data == data)]

    def owned(self) -> list[Matrix]:
        """The matrices this rank orthogonalizes."""
        return [m for m in self.assembling() if m.owner[1] == self.tp_rank]

    def data_moves(self, data: DataGroup) -> bool:
        """Whether any rank of `data` sends another a piece (known from the layout alone)."""
        return data.size > 1 and any(m.part(j)[1] for m in self.of(data)
                                     for j in range(data.size) if j != m.owner[0])

    def data_gather(self, data: DataGroup) -> list[list[Matrix]]:
        """Per data rank: the matrices whose piece this rank sends it (sharded groups only:
        a replica holds everything its owner needs)."""
        sends = [[] for _ in range(data.size)]
        if data.sharded and self.data_moves(data):
            for m in self.of(data):
                if m.owner[0] != data.index and m.part(data.index)[1]:
                    sends[m.owner[0]].append(m)
        return sends

    def data_scatter(self, data: DataGroup) -> list[list[Matrix]]:
        """Per data rank j: the matrices whose part j holds this rank sends back to it."""
        sends = [[] for _ in range(data.size)]
        if self.data_moves(data):
            for m in self.assembling(data):
                for j in range(data.size):
                    if j != data.index and m.part(j)[1]:
                        sends[j].append(m)
        return sends

    def tp_gather(self) -> list[list[Matrix]]:
        sends = [[] for _ in range(self.tp_size)]
        for m in self.assembling():
            if m.tp_dim is not None and m.owner[1] != self.tp_rank:
                sends[m.owner[1]].append(m)
        return sends

    def tp_gathers(self) -> bool:
        return self.tp_size > 1 and any(m.tp_dim is not None for m in self.assembling())

    def tp_scatter(self) -> list[list[Matrix]]:
        sends = [[] for _ in range(self.tp_size)]
        for m in self.owned():
            for t in range(self.tp_size):
                if t != self.tp_rank:
                    sends[t].append(m)
        return sends

    def tp_scatters(self) -> bool:
        return self.tp_size > 1 and bool(self.assembling())

    def traffic(self) -> list[tuple[DataGroup | None, int]]:
        """(data group, or None for tp; elements this rank sends) of each all-to-all it
        issues in a step; bf16 elements."""
        out = []
        for data in self.groups:
            if data.sharded and self.data_moves(data):
                out.append((data, sum(m.part(data.index)[1] for ms in self.data_gather(data)
                                      for m in ms)))
        if self.tp_gathers():
            out.append((None, sum(m.local_numel for ms in self.tp_gather() for m in ms)))
        if self.tp_scatters():
            out.append((None, sum(m.local_numel for ms in self.tp_scatter() for m in ms)))
        for data in self.groups:
            if self.data_moves(data):
                out.append((data, sum(m.part(j)[1] for j, ms in enumerate(self.data_scatter(data))
                                      for m in ms)))
        return out
