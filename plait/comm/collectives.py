"""Accounted collectives over an explicit process group.

Every collective plait issues goes through these wrappers. Each one adds to the process's ledger
the bytes it moves per rank by the ring convention (nccl-tests' "bus bytes"), for a group of n
ranks and a tensor of D bytes:

    all-reduce                      2 (n - 1) / n * D
    all-gather, reduce-scatter      (n - 1) / n * D   (D = the full, unsharded tensor)
    all-to-all                      (n - 1) / n * D   (D = this rank's input)
    broadcast, send                 D                 (recv moves nothing of its own)
    shift (send on around a ring)   D                 (booked as a send)

The count is the logical algorithm's, whatever the backend does underneath, so it is exact and
the same on gloo and NCCL; tests assert it against these formulas. The ledger is process-wide (like
a profiler) so that collectives deep inside autograd functions are counted without threading a
counter through every call; it holds numbers, never process groups.

A collective on a group of one is a no-op and is not recorded.

On gloo, a flat all-gather and a reduce-scatter each make a buffer the size of the whole tensor
(gloo gathers into a flat buffer of its own and copies out; its reduce-scatter all-reduces a clone
and copies a chunk out), once per call, in its worker thread or the caller's. ZeRO-3 calls them
for every unit twice a step, and those buffers, freed in between, are what fragments a CPU rank's
heap (`plait/parallel/engines/buffer_pool.py`). From `IN_PLACE` bytes on, on the CPU, plait does
without them: the all-gather is n broadcasts, rank r's from its own chunk of `output` (each rank
sends what the ring would: its chunk to the n - 1 others), and a reduce-scatter whose input the
caller no longer needs (`scratch`) is the same all-reduce as gloo's, in place, and a copy. The
ledger books the logical collective either way.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from plait.comm.trace import TRACER
from plait.comm.watchdog import RECORDER

# Every collective runs eagerly, also when called from a block that `train.compile` compiled: the
# call is a graph break that dynamo does not step into (the process group, the ledger's
# bookkeeping and the clocks it reads are not graph material; traced into, each resumed piece
# guarded on a timestamp and recompiled at every call). The differentiable collectives that call
# these (`plait.comm.autograd`) then run eagerly, whole, between the compiled pieces.
_eager = torch.compiler.disable

# torch 2.13 renamed the flat-tensor collectives; older releases only have the first names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Op(enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"
    SEND = "send"
    RECV = "recv"


def bus_bytes(op: Op, n: int, nbytes: int) -> Fraction:
    """Bytes one rank moves for `op` on n ranks and a D-byte tensor (see the module docstring)."""
    if n == 1 or op is Op.RECV:
        return Fraction(0)
    if op is Op.ALL_REDUCE:
        return Fraction(2 * (n - 1) * nbytes, n)
    if op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL):
        return Fraction((n - 1) * nbytes, n)
    return Fraction(nbytes)  # broadcast, send


@dataclass
class CommLedger:
    """What this process's collectives moved since the last `reset`."""

    bytes: Fraction = Fraction(0)
    bytes_by_op: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    wait_s: float = 0.0
    wait_by_op: Counter = field(default_factory=Counter)  # seconds blocked, per op

    def waited(self, op: Op, seconds: float) -> None:
        self.wait_s += seconds
        self.wait_by_op[op] += seconds

    def record(self, op: Op, n: int, nbytes: int) -> None:
        moved = bus_bytes(op, n, nbytes)
        self.bytes += moved
        self.bytes_by_op[op] += moved
        self.calls[op] += 1

    def reset(self) -> None:
        self.bytes, self.wait_s = Fraction(0), 0.0
        self.bytes_by_op.clear()
        self.calls.clear()
        self.wait_by_op.clear()

    def snapshot(self) -> dict:
        return {
            "bytes": float(self.bytes),
            "bytes_by_op": {op.value: float(b) for op, b in self.bytes_by_op.items()},
            "calls": {op.value: c for op, c in self.calls.items()},
            "wait_s": self.wait_s,
        }


LEDGER = CommLedger()


class Pending:
    """An asynchronous collective in flight; `wait()` blocks and books the time blocked (and,
    when tracing, the span from launch to the end of the wait)."""

    def __init__(self, work: dist.Work | None, traced: tuple | None = None,
                 op: Op = Op.ALL_REDUCE):
        self._work, self._traced, self._op = work, traced, op  # traced: (name, launched at, args)

    @_eager
    def wait(self) -> None:
        if self._work is not None:
            start = time.perf_counter()
            self._work.wait()
            end = time.perf_counter()
            LEDGER.waited(self._op, end - start)
            if self._traced is not None:
                name, launched, args = self._traced
                TRACER.overlapping(name, "collective", launched, end, **args)
            self._work = None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


IN_PLACE = 1 << 20  # bytes: gloo's own collectives below this (one call; small buffers are cheap)


class _Together:
    """Works in flight that finish as one: wait for each, then `then()`."""

    def __init__(self, works: list, then=None):
        self._works, self._then = works, then

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        if self._then is not None:
            self._then()
            self._then = None
        return True


def _in_place(t: torch.Tensor, group: ProcessGroup) -> bool:
    """Whether plait's own gloo path (no whole-tensor buffer of gloo's) takes `t`."""
    return (_nbytes(t) >= IN_PLACE and t.device.type == "cpu" and t.is_contiguous()
            and "gloo" in str(dist.get_backend(group)))


def _broadcast_all_gather(output, shard, group, async_op):
    """All-gather as n broadcasts into `output`'s chunks, in place (no flat buffer of gloo's)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = output.view(n, -1)  # (n, shard numel), rank-major
    chunks[me].copy_(shard.reshape(-1))
    work = _Together([dist.broadcast(chunks[r], group_src=r, group=group, async_op=True)
                      for r in range(n)])
    return work if async_op else work.wait()


def _all_reduce_scatter(output, full, op, group, async_op):
    """Reduce-scatter as gloo runs it (an all-reduce, then this rank's chunk), on `full` itself
    rather than a clone: `full` is the caller's scratch."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    work = _Together([dist.all_reduce(full, op=op, group=group, async_op=True)],
                     lambda: output.copy_(full.view(n, -1)[me].view(output.shape)))
    return work if async_op else work.wait()


def _run(op: Op, group: ProcessGroup, nbytes: int, call, async_op: bool) -> Pending | None:
    n = dist.get_world_size(group)
    LEDGER.record(op, n, nbytes)
    entry = RECORDER.record(op.value, group, nbytes)
    start, args = time.perf_counter(), None
    if TRACER.on:
        args = {"ranks": list(entry.ranks), "tensor_bytes": nbytes,
                "bus_bytes": float(bus_bytes(op, n, nbytes))}
    if async_op:
        return Pending(call(True), (op.value, start, args) if args is not None else None, op)
    call(False)
    end = time.perf_counter()
    LEDGER.waited(op, end - start)
    if args is not None:
        TRACER.complete(op.value, "collective", start, end, **args)
    return None


@_eager
def all_reduce(
    tensor: torch.Tensor, group: ProcessGroup, op: ReduceOp = ReduceOp.SUM, async_op: bool = False
) -> Pending | None:
    """In place: every rank ends with the reduction of all ranks' `tensor`."""
    if dist.get_world_size(group) == 1:
        return Pending(None) if async_op else None
    return _run(
        Op.ALL_REDUCE, group, _nbytes(tensor),
        lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), async_op,
    )


@_eager
def all_reduced(
    tensor: torch.Tensor, group: ProcessGroup, op: ReduceOp = ReduceOp.SUM
) -> torch.Tensor:
    """A reduced copy, `tensor` left as it was: for autograd functions and gradient hooks, which
    must not modify their inputs."""
    out = tensor.contiguous().clone()
    all_reduce(out, group, op)
    return out


@_eager
def all_gather(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool = False
) -> Pending | None:
    """`output` (n * shard.numel() elements, rank-major along dim 0) <- every rank's `shard`."""
    if dist.get_world_size(group) == 1:
        output.copy_(shard.reshape(output.shape))
        return Pending(None) if async_op else None
    if _in_place(output, group):
        return _run(Op.ALL_GATHER, group, _nbytes(output),
                    lambda a: _broadcast_all_gather(output, shard, group, a), async_op)
    return _run(
        Op.ALL_GATHER, group, _nbytes(output),
        lambda a: _all_gather_flat(output, shard, group=group, async_op=a), async_op,
    )


@_eager
def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    group: ProcessGroup,
    op: ReduceOp = ReduceOp.SUM,
    async_op: bool = False,
    scratch: bool = False,
) -> Pending | None:
    """`output` <- this rank's 1/n chunk (along dim 0) of the reduction of every rank's `full`.
    `scratch`: the caller no longer needs `full`, which may be left holding anything."""
    if dist.get_world_size(group) == 1:
        output.copy_(full.reshape(output.shape))
        return Pending(None) if async_op else None
    if scratch and _in_place(full, group):
        return _run(Op.REDUCE_SCATTER, group, _nbytes(full),
                    lambda a: _all_reduce_scatter(output, full, op, group, a), async_op)
    return _run(
        Op.REDUCE_SCATTER, group, _nbytes(full),
        lambda a: _reduce_scatter_flat(output, full, op=op, group=group, async_op=a), async_op,
    )


def barrier(group: ProcessGroup) -> None:
    """Every rank of `group` reaches this point before any goes on. No tensor moves: the ledger
    counts nothing."""
    if dist.get_world_size(group) > 1:
        dist.barrier(group=group)


@_eager
def broadcast(
    tensor: torch.Tensor, src: int, group: ProcessGroup, async_op: bool = False
) -> Pending | None:
    """In place, from `src`, the source's rank *within* `group`."""
    if dist.get_world_size(group) == 1:
        return Pending(None) if async_op else None
    src_global = dist.get_global_rank(group, src)
    return _run(
        Op.BROADCAST, group, _nbytes(tensor),
        lambda a: dist.broadcast(tensor, src=src_global, group=group, async_op=a), async_op,
    )


@_eager
def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
    async_op: bool = False,
) -> Pending | None:
    """Chunk i of this rank's `input` (along dim 0) goes to rank i; `output` holds, rank-major, what
    every rank sent here. Splits give uneven chunk sizes in rows."""
    if dist.get_world_size(group) == 1:
        output.copy_(input)
        return Pending(None) if async_op else None
    return _run(
        Op.ALL_TO_ALL, group, _nbytes(input),
        lambda a: dist.all_to_all_single(
            output, input, output_splits, input_splits, group=group, async_op=a
        ),
        async_op,
    )


@_eager
def send(tensor: torch.Tensor, dst: int, group: ProcessGroup, async_op: bool = False,
         tag: int = 0):
    """To `dst`, a rank within `group`; the receiver's `tag` must match."""
    dst_global = dist.get_global_rank(group, dst)
    call = lambda a: (dist.isend if a else dist.send)(tensor, dst=dst_global, group=group, tag=tag)
    return _run(Op.SEND, group, _nbytes(tensor), call, async_op)


@_eager
def recv(tensor: torch.Tensor, src: int, group: ProcessGroup, async_op: bool = False,
         tag: int = 0):
    """Into `tensor`, from `src`, a rank within `group`."""
    src_global = dist.get_global_rank(group, src)
    call = lambda a: (dist.irecv if a else dist.recv)(tensor, src=src_global, group=group, tag=tag)
    return _run(Op.RECV, group, _nbytes(tensor), call, async_op)


class _Batch:
    """The works of one batch of point-to-point operations, waited together."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


@_eager
def shift(tensor: torch.Tensor, out: torch.Tensor, group: ProcessGroup, tag: int = 0,
          async_op: bool = False) -> Pending | None:
    """Around the ring of `group`'s ranks: `tensor` to the next rank, `out` <- the previous rank's
    (one batch of a send and a receive, so NCCL runs every rank's pair together and cannot
    deadlock). Booked as a send of `tensor`."""
    n = dist.get_world_size(group)
    if n == 1:
        out.copy_(tensor)
        return Pending(None) if async_op else None
    me = dist.get_rank(group)
    ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (me + 1) % n), group, tag),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(group, (me - 1) % n), group, tag)]

    def call(a: bool):
        batch = _Batch(dist.batch_isend_irecv(ops))
        if not a:
            batch.wait()
        return batch

    return _run(Op.SEND, group, _nbytes(tensor), call, async_op)
