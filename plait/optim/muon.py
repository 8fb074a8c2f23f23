"""Muon under every layout: each matrix orthogonalized whole, once per step, by the rank that
owns it (docs/parallelisms.md#muon-under-every-layout).

Muon (Jordan et al. 2024; `torch.optim.Muon`) keeps an elementwise momentum per matrix and
replaces the update by the nearest semi-orthogonal matrix, found by Newton-Schulz iterations on
the *whole* matrix. The layouts cut matrices: ZeRO into flat slices over the sharding group, tensor
parallelism along a dim over tp, pipelines and experts into whole matrices on one coordinate. So:

- the momentum and the Nesterov mix are elementwise: each rank computes them on what it holds
  (a slice, a tp shard, a whole matrix), and the state stays as sharded as AdamW's would;
- each matrix has one owner, a (data-group index, tp index) pair, chosen so that the
  Newton-Schulz FLOPs are balanced over the ranks that hold pieces of the matrices (largest
  first, to the least loaded; the same answer on every rank, from shapes alone);
- the update comes together in two levels and goes back the same way, in four all-to-alls:
  (1) over the data group that holds the tp shard: ZeRO slices to the data owner (whole
  replicas, as under DDP, send nothing); (2) over tp: each shard to the tp owner, which
  concatenates them along the split dim (a matrix tp replicates is whole there already); the
  owner orthogonalizes; (2') each tp rank gets its shard back; (1') each data rank its slice
  (replicas: the whole shard).
- Levels of one rank, or with nothing to send on any rank, issue no collective.

torch's Newton-Schulz rounds its input to bf16 first and returns bf16, so the exchange ships bf16
both ways: the same bits as one process, half the bytes of fp32. Under HSDP each replica group
computes the same updates (as it does for AdamW).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch.optim.Muon's own Newton-Schulz and learning-rate adjustment (private in torch 2.13, the
# version plait pins): the owners compute what `torch.optim.Muon` computes, bit for bit
# (tests/dist/test_muon.py fails first if they move).
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from plait.comm import all_to_all
from plait.mesh import Axis
from plait.optim.muon_routes import DataGroup, Matrix, MatrixBuffer, Routes, plan_matrices

SHIPPED = torch.bfloat16  # what Newton-Schulz computes in: its input is rounded to it first


@dataclass
class HeldPiece:
    """Elements [lo, lo + count) of a tensor the optimizer steps are elements [start, start +
    count) of `matrix`'s flattened tp shard."""

    matrix: Matrix
    lo: int
    start: int
    count: int


def engine_buffers(engine) -> list[tuple[MatrixBuffer, object]]:
    """(MatrixBuffer, the flat parameter) for each of the engine's flat buffers holding a matrix."""
    out, groups = [], {}
    for flat in engine.flat_buffers():
        if not any(n in engine.matrices for n in flat.names):
            continue
        key = (id(flat.group), flat.size > 1)
        if key not in groups:
            groups[key] = DataGroup(flat.group, _size(flat.group), _rank(flat.group),
                                    flat.size > 1)
        out.append((MatrixBuffer(groups[key], tuple(flat.segments), flat.shard_numel), flat))
    return out


class MatrixExchange:
    """The owners of the matrices an engine's flat buffers hold, and the all-to-alls that bring
    each update whole to its owner and the orthogonalized one back (module docstring)."""

    def __init__(self, engine, record, tp: Axis):
        self.tp = tp
        buffers = engine_buffers(engine)
        self.matrices = plan_matrices([b for b, _ in buffers], engine.matrices, record, tp.size)
        self.routes = Routes(self.matrices, tp.rank, tp.size)
        self.pieces: dict[int, list[HeldPiece]] = {}  # id(stepped tensor) -> its pieces
        self.spans: dict[str, tuple[int, int]] = {}  # matrix -> (start, count) held here
        by_name = {m.name: m for m in self.matrices}
        slices = engine.storage_axis is not None  # ZeRO steps slices; DDP the parameters
        for buffer, flat in buffers:
            data = buffer.data
            for position, segment in enumerate(flat.segments):
                m = by_name.get(segment.name)
                if m is None:
                    continue
                start, count = m.part(data.index)
                if slices and count:  # this rank's slice of the flat buffer
                    lo = segment.offset + start - data.index * flat.shard_numel
                    self._hold(flat.slice.master, HeldPiece(m, lo, start, count))
                elif not slices:
                    self._hold(flat.params[position], HeldPiece(m, 0, 0, m.local_numel))

    def _hold(self, tensor: torch.Tensor, piece: HeldPiece) -> None:
        self.pieces.setdefault(id(tensor), []).append(piece)
        self.spans[piece.matrix.name] = (piece.start, piece.count)

    # -- one step ------------------------------------------------------------------------------

    def orthogonalize(self, updates: dict[int, torch.Tensor], coefficients, steps: int,
                      eps: float) -> dict[str, torch.Tensor]:
        """`updates`: id(stepped tensor) -> its Nesterov update (the tensor's shape). Returns,
        per matrix this rank holds a piece of, the orthogonalized update of that piece's
        elements (flattened; bf16)."""
        whole = self.gather(updates, SHIPPED)
        return self.scatter({name: _zeropower_via_newtonschulz(w, coefficients, steps, eps)
                             for name, w in whole.items()}, SHIPPED)

    def gather(self, values: dict[int, torch.Tensor], dtype: torch.dtype
               ) -> dict[str, torch.Tensor]:
        """`values`: id(stepped tensor) -> a tensor of its shape (an update, a gradient, the
        tensor itself). Returns each matrix this rank owns, whole (its own copy, in `dtype`)."""
        mine: dict[str, torch.Tensor] = {}
        for key, value in values.items():
            flat = value.reshape(-1)
            for piece in self.pieces.get(key, []):
                mine[piece.matrix.name] = flat[piece.lo : piece.lo + piece.count].to(
                    dtype, copy=True)
        device = next(iter(values.values())).device if values else torch.device("cpu")
        shards = {}  # name -> the whole tp shard (where this rank assembles it)
        for data in self.routes.groups:
            shards.update(self._gather_data(data, mine, device, dtype))
        return self._gather_tp(shards, device, dtype)

    def scatter(self, whole: dict[str, torch.Tensor], dtype: torch.dtype
                ) -> dict[str, torch.Tensor]:
        """`whole`: each matrix this rank owns (`gather`'s keys), in `dtype`. Returns, per matrix
        this rank holds a piece of, that piece's elements of it (flattened)."""
        device = next(iter(whole.values())).device if whole else torch.device("cpu")
        shards = self._scatter_tp(whole, device, dtype)
        out: dict[str, torch.Tensor] = {}
        for data in self.routes.groups:
            out.update(self._scatter_data(data, shards, device, dtype))
        return out

    def _gather_data(self, data: DataGroup, mine, device, dtype) -> dict[str, torch.Tensor]:
        here = self.routes.assembling(data)
        out = {m.name: self._whole_shard(m, mine, device, dtype) for m in here}
        if not data.sharded or not self.routes.data_moves(data):  # the owner holds it all
            return out
        sends = self.routes.data_gather(data)
        recv = [sum(m.part(j)[1] for m in here) if j != data.index else 0
                for j in range(data.size)]
        received = _exchange(data.group, [[mine[m.name] for m in ms] for ms in sends], recv,
                             device, dtype)
        for j, chunk in enumerate(received):
            at = 0
            for m in here:
                start, count = m.part(j)
                if j != data.index and count:
                    out[m.name][start : start + count] = chunk[at : at + count]
                    at += count
        return out

    def _whole_shard(self, m: Matrix, mine, device, dtype) -> torch.Tensor:
        """The tp shard's buffer, with this rank's own piece in place."""
        if m.name in mine and mine[m.name].numel() == m.local_numel:
            return mine[m.name]
        shard = torch.empty(m.local_numel, dtype=dtype, device=device)
        if m.name in mine:
            start, count = self.spans[m.name]
            shard[start : start + count] = mine[m.name]
        return shard

    def _scatter_data(self, data: DataGroup, shards, device, dtype) -> dict[str, torch.Tensor]:
        """Each data rank gets its part of the tp shard from the rank that assembled it."""
        out = {}
        for m in self.routes.assembling(data):
            if m.name in self.spans:
                out[m.name] = shards[m.name][slice(*_span(self.spans[m.name]))]
        if not self.routes.data_moves(data):
            return out
        sends = [[shards[m.name][slice(*_span(m.part(j)))] for m in ms]
                 for j, ms in enumerate(self.routes.data_scatter(data))]
        mats = self.routes.of(data)
        recv = [sum(m.part(data.index)[1] for m in mats if m.owner[0] == j)
                if j != data.index else 0 for j in range(data.size)]
        received = _exchange(data.group, sends, recv, device, dtype)
        for j, chunk in enumerate(received):
            at = 0
            for m in mats:
                count = m.part(data.index)[1]
                if m.owner[0] == j and j != data.index and count:
                    out[m.name] = chunk[at : at + count]
                    at += count
        return out

    def _gather_tp(self, shards: dict[str, torch.Tensor], device, dtype
                   ) -> dict[str, torch.Tensor]:
        """Each tp shard to the tp owner, which stacks them along the split dim."""
        tp = self.tp
        here = self.routes.assembling()
        out = {m.name: shards[m.name].view(m.shape) for m in here
               if m.owner[1] == tp.rank and (m.tp_dim is None or tp.size == 1)}
        if not self.routes.tp_gathers():
            return out
        split = [m for m in here if m.tp_dim is not None]
        recv = [sum(m.local_numel for m in split if m.owner[1] == tp.rank) if t != tp.rank else 0
                for t in range(tp.size)]
        received = _exchange(tp.group, [[shards[m.name] for m in ms]
                                        for ms in self.routes.tp_gather()], recv, device, dtype)
        pieces = {m.name: [None] * tp.size for m in split if m.owner[1] == tp.rank}
        for name in pieces:
            pieces[name][tp.rank] = shards[name]
        for t, chunk in enumerate(received):
            at = 0
            for m in split:
                if m.owner[1] == tp.rank and t != tp.rank:
                    pieces[m.name][t] = chunk[at : at + m.local_numel]
                    at += m.local_numel
        for m in split:
            if m.name in pieces:
                out[m.name] = torch.cat([p.view(m.local_shape) for p in pieces[m.name]],
                                        dim=m.tp_dim)
        return out

    def _scatter_tp(self, whole: dict[str, torch.Tensor], device, dtype
                    ) -> dict[str, torch.Tensor]:
        """Each tp rank gets its shard of each matrix its tp group's owner holds whole (a matrix
        tp replicates: the whole of it), flattened."""
        tp = self.tp
        out = {m.name: _tp_part(m, whole[m.name], tp.rank) for m in self.routes.owned()}
        if not self.routes.tp_scatters():
            return out
        here = self.routes.assembling()
        sends = [[_tp_part(m, whole[m.name], t) for m in ms]
                 for t, ms in enumerate(self.routes.tp_scatter())]
        recv = [sum(m.local_numel for m in here if m.owner[1] == t) if t != tp.rank else 0
                for t in range(tp.size)]
        received = _exchange(tp.group, sends, recv, device, dtype)
        for t, chunk in enumerate(received):
            at = 0
            for m in here:
                if m.owner[1] == t and t != tp.rank:
                    out[m.name] = chunk[at : at + m.local_numel]
                    at += m.local_numel
        return out


def _exchange(group, sends: list[list[torch.Tensor]], recv: list[int], device: torch.device,
              dtype: torch.dtype = SHIPPED) -> list[torch.Tensor]:
    """One all-to-all: sends[j] concatenated to rank j; returns what each rank sent here
    (recv[j] elements)."""
    flat = [t.reshape(-1) for out in sends for t in out]
    payload = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    arriving = torch.empty(sum(recv), dtype=dtype, device=device)
    all_to_all(arriving, payload, group, output_splits=recv,
               input_splits=[sum(t.numel() for t in out) for out in sends])
    return list(arriving.split(recv))


def _span(part: tuple[int, int]) -> tuple[int, int]:
    return part[0], part[0] + part[1]


def _tp_part(m: Matrix, whole: torch.Tensor, t: int) -> torch.Tensor:
    if m.tp_dim is None:
        return whole.reshape(-1)
    n = m.local_shape[m.tp_dim]
    return whole.narrow(m.tp_dim, t * n, n).contiguous().view(-1)


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the matrices (`torch.optim.Muon`'s update, under any layout through a
    `MatrixExchange`), AdamW (torch's) for the rest, as one optimizer: one `state` and one list of
    parameter groups (each group's "algorithm" says which), so the trainer, the learning-rate
    schedule and the checkpoints drive it like AdamW. Each group's lr is the schedule's times its
    "lr_ratio"."""

    def __init__(self, matrices: list[torch.Tensor], decay: list[torch.Tensor],
                 no_decay: list[torch.Tensor], exchange: MatrixExchange, *, lr: float,
                 weight_decay: float, betas: tuple[float, float], momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr_fn: str = "original",
                 lr_ratio: float = 1.0, eps: float = 1e-7,
                 coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)):
        adamw = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas)
        groups = [dict(g, algorithm="adamw", lr_ratio=1.0) for g in adamw.param_groups]
        groups.append({"params": matrices, "algorithm": "muon", "lr": lr * lr_ratio,
                       "lr_ratio": lr_ratio, "weight_decay": weight_decay,
                       "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
                       "adjust_lr_fn": adjust_lr_fn, "eps": eps, "coefficients": coefficients})
        super().__init__(groups, {})
        self.exchange = exchange
        self._adamw = adamw
        adamw.param_groups = [g for g in self.param_groups if g["algorithm"] == "adamw"]
        adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        self._adamw.step()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                self._muon(group)

    def _muon(self, group: dict) -> None:
        momentum, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
        params = [p for p in group["params"] if p.grad is not None]
        updates = {}
        for p in params:  # torch.optim.Muon's momentum, elementwise on what this rank holds
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            updates[id(p)] = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
        ortho = self.exchange.orthogonalize(updates, group["coefficients"], group["ns_steps"],
                                            group["eps"])
        for p in params:
            p.mul_(1 - lr * decay)
            flat = p.view(-1)
            for piece in self.exchange.pieces.get(id(p), []):
                m = piece.matrix
                flat[piece.lo : piece.lo + piece.count].add_(
                    ortho[m.name], alpha=-_adjust_lr(lr, group["adjust_lr_fn"], m.shape))
