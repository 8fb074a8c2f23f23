"""Data parallelism: replicas of the model on the ranks of the `dp` axis, gradients averaged.

Every data-parallel engine (these two, ZeRO-1/2 in `zero.py`, ZeRO-3 in `zero3.py`) offers one
interface, `SyncedReplicas`, so the trainer never asks which one it drives: `no_sync()`,
`finish_gradients()` after the step's last backward, `optimizer_groups()` (what the optimizer
owns), `finish_step()` after the optimizer step, `grad_pieces()` (this rank's averaged gradient,
by parameter name, for the global norm), `storage_axis` (the ranks over which it partitions the
replicas' storage, if it does) and `state_bytes(optimizer)`.

Under expert parallelism an engine's parameters fall into two classes (`sync_classes`): the
dense ones, averaged over the dp x ep ranks that split the batch (the engine's group), and the
experts, summed over the dp ranks that hold the same experts (`overrides`), divided by the same
dp x ep. Each flat buffer holds one class and communicates on its group.

Every engine takes an optional `Compression` (`plait.comm.compression`): while it is active, each
flat buffer's reduction is the method's (an all-reduce for DDP, a reduce-scatter for ZeRO) instead
of the plain one, launched and waited on at the same points, in the same bucket order on every
rank; its state (error feedback, PowerSGD's Q) counts as model state, under "compression".

Two engines that keep whole replicas, tested against each other:

- `NaiveDataParallel`: after the step's last backward, one all-reduce of all gradients flattened
  together. Nothing overlaps; it is the simple reference.
- `BucketedDataParallel`: gradients are copied into buckets (flat parameters, `flat.py`) as backward
  produces them (post-accumulate-grad hooks), and the parameter lets go of its own copy, so
  gradients are held once; a full bucket's all-reduce starts at once, asynchronously, while
  backward goes on, and `finish_gradients` waits for the ones still in flight and hands each
  parameter its slice of the bucket as `.grad`. Under `no_sync()` (the micro-batches of gradient
  accumulation before the last) gradients accumulate in `.grad` as usual and nothing is
  communicated.

  With a half `param_dtype` (`train.param_dtype`, FSDP2's MixedPrecisionPolicy for whole
  replicas) each bucket is a flat parameter held in it, whose fp32 master the optimizer steps
  (`flat.FlatParam` with one rank: the slice is the whole bucket). Buckets never mix optimizer
  classes, as ZeRO's. Every micro-batch's half gradient is added into the bucket's fp32
  gradient (under `no_sync` too: accumulation in fp32), which is all-reduced in fp32 and is the
  master's gradient; `finish_step` rounds the masters into the parameters. One device (a group
  of one) takes the same path, without the all-reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from plait.comm import Pending, all_reduce, broadcast
from plait.comm.allreduce import AllReduceAlgorithm, NodeGroups, all_reduce_by
from plait.comm.buckets import assign_buckets
from plait.comm.compression import Compression
from plait.parallel.engines.flat import (
    FlatParam,
    optimizer_classes,
    stepped_by_group,
    stepped_classes,
)
from plait.parallel.engines.state import Piece, model_state_bytes, nbytes, optimizer_state_bytes


def sync_classes(named: list, default, overrides: dict) -> list[tuple[object, list]]:
    """(group, members) for each group over which parameters' gradients are summed: `default`'s
    members first, then those of each group in `overrides` (name -> group; experts over dp under
    expert parallelism), order kept. Flat buffers never mix classes."""
    out = {default: []}
    for n, p in named:
        out.setdefault(overrides.get(n, default), []).append((n, p))
    return [(group, members) for group, members in out.items() if members]


def _broadcast_replicas(module: nn.Module, group: ProcessGroup,
                        overrides: dict[str, ProcessGroup] | None = None) -> None:
    """Replicas start equal: parameters and buffers from the first rank of the group that holds
    their replicas."""
    overrides = overrides or {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            broadcast(p.data, src=0, group=overrides.get(name, group))
        for t in module.buffers():
            broadcast(t.data, src=0, group=group)


def _check_all_have_grads(module: nn.Module, also_present: set[str] = frozenset()) -> None:
    missing = [
        n for n, p in module.named_parameters()
        if p.requires_grad and p.grad is None and n not in also_present
    ]
    if missing:
        raise RuntimeError(
            f"parameters got no gradient this step: {', '.join(missing)}; every parameter must "
            "take part in the loss (or set requires_grad=False on the unused ones, or "
            "parallel.unused_parameters = true: their gradient is then zero)"
        )


def _zero_grads(module: nn.Module) -> None:
    """A zero gradient for each parameter of `module` that got none (`unused_parameters`)."""
    for p in module.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def fill_unused(buckets: list, hooks: dict) -> None:
    """Each bucket position no gradient reached this step gets one, zero unless micro-batches
    before the last left one in the parameter, through its own hook (`hooks[(index,
    position)]`), bucket by bucket in index order: the order every rank launches them in."""
    for index, bucket in enumerate(buckets):
        for position, p in enumerate(bucket.params):
            if position not in bucket.ready:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                hooks[index, position](p)


def launch_ready(buckets: list, start: int, launch: Callable) -> int:
    """Launch, in index order from `start`, every bucket whose gradients have all arrived; return
    the index of the first one still waiting. A bucket may fill before an earlier one (backward
    order is only roughly reversed registration order); launching strictly in index order keeps
    the ranks' collectives in step."""
    while start < len(buckets) and len(buckets[start].ready) == len(buckets[start].params):
        launch(buckets[start])
        start += 1
    return start


class SyncedReplicas(nn.Module):
    """What every gradient-synchronising engine shares: it runs the wrapped module, and under
    `no_sync()` (the micro-batches of gradient accumulation before the last) its hooks let
    gradients accumulate locally and communicate nothing. The defaults below are those of an
    engine that keeps whole replicas (DDP); the sharded engines override them."""

    _sync = True
    # parallel.unused_parameters: a parameter no gradient reached in a step gets a zero one
    # (DDP's find_unused_parameters; FSDP's flat parameters reduce zeros for them), else the
    # step stops naming it. Every rank's step must still run its modules in the same order.
    zero_unused = False
    compression: Compression | None = None
    # The ranks over which the engine partitions the replicas' storage (ZeRO: its sharding
    # group), whose gradient pieces are disjoint parts of one whole; None for whole replicas.
    storage_axis = None
    _frozen_bytes: int | None = None  # `frozen_bytes`, once counted
    # Under expert parallelism with a storage axis over dp x ep: its dp part, the experts'
    # sharding group (all of dp; under hybrid sharding the experts' dp_shard group).
    expert_axis = None
    matrices: frozenset[str] = frozenset()  # what a matrix optimizer (Muon) steps, by name
    groups: dict[str, str] = {}  # noqa: RUF012 - name -> the user's parameter group (read only)

    def optimizer_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(decay, no_decay): matrices and embeddings decay, norm gains do not; a matrix
        optimizer's matrices are `matrix_tensors`."""
        named = [(n, p) for n, p in self.module.named_parameters()
                 if p.requires_grad and n not in self.matrices]
        return [p for _, p in named if p.dim() >= 2], [p for _, p in named if p.dim() < 2]

    def matrix_tensors(self) -> list[torch.Tensor]:
        """What a matrix optimizer steps: whole (tensor-parallel) matrices here."""
        return [p for n, p in self.module.named_parameters() if n in self.matrices]

    def param_groups(self) -> dict[str | None, list[torch.Tensor]]:
        """What the optimizer steps elementwise, by the user's parameter group (`groups`: name
        -> group; None for a parameter it does not name)."""
        out: dict[str | None, list[torch.Tensor]] = {}
        for n, p in self.module.named_parameters():
            if p.requires_grad and n not in self.matrices:
                out.setdefault(self.groups.get(n), []).append(p)
        return out

    def held_pieces(self) -> list[Piece]:
        """What the optimizer steps, by parameter (the checkpoint's layout): whole parameters."""
        return [Piece(name, p, 0, 0, p.numel()) for name, p in self.module.named_parameters()
                if p.requires_grad]

    def frozen_pieces(self) -> list[Piece]:
        """The parameters no optimizer steps (`requires_grad=False`: a fine-tuning's frozen
        layers): every engine keeps them whole on every rank (as tp and pp place them), reduces
        nothing for them, and a checkpoint holds them with the model."""
        return [Piece(name, p, 0, 0, p.numel()) for name, p in self.module.named_parameters()
                if not p.requires_grad]

    def frozen_bytes(self) -> int:
        """Their bytes (counted once: what is frozen stays so)."""
        if self._frozen_bytes is None:
            self._frozen_bytes = nbytes(piece.tensor for piece in self.frozen_pieces())
        return self._frozen_bytes

    def grad_pieces(self):
        """(name, this rank's averaged gradient of it) after `finish_gradients`."""
        for name, p in self.module.named_parameters():
            if p.grad is not None:
                yield name, p.grad

    def finish_step(self) -> None:
        """After the optimizer step; replicas updated themselves."""

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return self._with_peak(model_state_bytes(self.module, optimizer))

    def _with_compression(self, state: dict[str, int]) -> dict[str, int]:
        if self.compression is not None:
            state["compression"] = self.compression.state_bytes()
        return state

    def begin_step(self) -> None:
        """Before a step's first forward (the sharded engines measure the step's peak)."""

    def _with_peak(self, state: dict[str, int]) -> dict[str, int]:
        """The end-of-step figures and "peak", the most held at once during the step: whole
        replicas hold all of it all step long (DDP's gradient buckets persist)."""
        state = self._with_compression(state)
        state["peak"] = sum(state.values())
        return state

    def flat_buffers(self) -> list:
        """The flat buffers (`FlatParam`: key, segments, full, group) whose reductions a
        compression method replaces; their state is keyed by them."""
        return []

    def _compressing(self, n: int) -> bool:
        return self.compression is not None and self.compression.active(n)

    def _step_done(self) -> None:
        """End of the step's gradient reduction (counts steps towards compression's start)."""
        if self.compression is not None:
            self.compression.step_done()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        self._sync = False
        try:
            yield
        finally:
            self._sync = True


class NaiveDataParallel(SyncedReplicas):
    """One flat all-reduce of every gradient after backward (so `no_sync` has nothing to stop)."""

    def __init__(self, module: nn.Module, group: ProcessGroup):
        super().__init__()
        self.module, self.group = module, group
        self.size = dist.get_world_size(group)
        _broadcast_replicas(module, group)

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """Average the gradients over the group; call once after the step's last backward."""
        if self.zero_unused:
            _zero_grads(self.module)
        _check_all_have_grads(self.module)
        if self.size == 1:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        all_reduce(flat, self.group)
        flat /= self.size
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()


class BucketedDataParallel(SyncedReplicas):
    """Bucketed gradient all-reduce overlapped with backward."""

    def __init__(
        self,
        module: nn.Module,
        group: ProcessGroup,
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        algorithm: AllReduceAlgorithm = AllReduceAlgorithm.BACKEND,
        compression: Compression | None = None,
        overrides: dict[str, ProcessGroup] | None = None,
        nodes: dict[ProcessGroup, NodeGroups] | None = None,
        matrices: frozenset[str] = frozenset(),
        groups: dict[str, str] | None = None,
        param_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.module, self.group, self.algorithm = module, group, algorithm
        self.matrices, self.groups = matrices, groups or {}
        self.nodes = nodes or {}  # the hierarchical all-reduce's view of each group
        self.compression = compression
        self.size = dist.get_world_size(group)  # the divisor: every rank's loss is a mean
        _broadcast_replicas(module, group, overrides)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        caps = int(bucket_mb * 2**20), int(min(first_bucket_mb, bucket_mb) * 2**20)
        self.masters = param_dtype is not None  # half parameters, fp32 masters
        self.buckets: list[FlatParam] = []
        for sync, members in sync_classes(named, group, overrides or {}):
            if self.masters:  # one optimizer class per bucket: the master is one tensor
                classes = optimizer_classes(members, matrices, self.groups)
            else:
                classes = [(members, None, False, None)]
            for cls, decay, matrix, name in classes:
                for bucket_members in assign_buckets(cls, *caps):
                    bucket = FlatParam(bucket_members, decay, 1, 0, param_dtype,
                                       index=len(self.buckets), matrix=matrix, group_name=name)
                    bucket.group = sync  # the bucket's all-reduce
                    # Kept: the parameters' .grad view it (fp32 with masters: theirs).
                    bucket.grad = torch.zeros_like(bucket.slice.master)
                    bucket.grad_shard = bucket.grad  # the whole is this rank's "slice"
                    self.buckets.append(bucket)
        self._grad_views = [b.views(b.grad) for b in self.buckets]  # by bucket index
        self._next = 0  # buckets are launched in index order, the same on every rank
        self._in_flight: list[tuple[FlatParam, Pending]] = []
        self._hooks: dict[tuple[int, int], Callable] = {}  # (bucket, position) -> its hook
        if self.size > 1 or self.masters:
            for bucket in self.buckets:
                for position, p in enumerate(bucket.params):
                    hook = self._hooks[bucket.index, position] = self._hook(bucket, position)
                    p.register_post_accumulate_grad_hook(hook)

    def _hook(self, bucket: FlatParam, position: int):
        def on_gradient(p: nn.Parameter) -> None:
            if self.masters:  # every micro-batch's half gradient, summed in fp32
                self._grad_views[bucket.index][position].add_(p.grad, alpha=1 / self.size)
                p.grad = None
            if not self._sync:
                return
            if self.masters:
                bucket.ready.add(position)
                self._next = launch_ready(self.buckets, self._next, self._launch)
                return
            # Average on the way in (g / n, summed by the all-reduce), during backward, rather
            # than dividing the whole bucket after the wait, on the critical path.
            torch.div(p.grad, self.size, out=self._grad_views[bucket.index][position])
            p.grad = None  # the bucket holds it now; backward can reuse the memory
            bucket.ready.add(position)
            self._next = launch_ready(self.buckets, self._next, self._launch)

        return on_gradient

    def flat_buffers(self) -> list[FlatParam]:
        return self.buckets

    def _launch(self, bucket: FlatParam) -> None:
        """The bucket's all-reduce (in place: the mean comes back in `bucket.grad`)."""
        if self.size == 1:
            return  # one device (masters): nothing to reduce
        if self._compressing(dist.get_world_size(bucket.group)):
            pending = self.compression.method.all_reduce(bucket.key, bucket.grad,
                                                         bucket.segments, bucket.group)
        else:
            pending = all_reduce_by(self.algorithm, bucket.grad, bucket.group,
                                    self.nodes.get(bucket.group))
        self._in_flight.append((bucket, pending))

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """Wait for every bucket's all-reduce and hand the averaged gradients to the parameters.
        Call once after the step's last backward (outside `no_sync`)."""
        if self.zero_unused and self._hooks:
            fill_unused(self.buckets, self._hooks)
        elif self.zero_unused:
            _zero_grads(self.module)
        if self.masters:
            self._hand_to_masters()
            return
        if self.size == 1:
            _check_all_have_grads(self.module)
            return
        _check_all_have_grads(self.module, {b.names[i] for b in self.buckets for i in b.ready})
        if self._next != len(self.buckets):  # every gradient exists, but some bucket never filled
            late = [n for b in self.buckets[self._next :] for i, n in enumerate(b.names)
                    if i not in b.ready]
            raise RuntimeError(f"gradients arrived outside the last backward for: {late}; "
                               "call finish_gradients after a backward run outside no_sync()")
        for bucket, pending in self._in_flight:
            pending.wait()
            for p, view in zip(bucket.params, self._grad_views[bucket.index], strict=True):
                p.grad = view  # the optimizer reads the bucket in place
            bucket.ready.clear()
        self._in_flight.clear()
        self._next = 0
        self._step_done()

    def _hand_to_masters(self) -> None:
        """Half parameters: the buckets' averaged fp32 gradients are the masters' (the
        parameters' `.grad` stay None: what the optimizer steps is the masters)."""
        ready = {b.names[i] for b in self.buckets for i in b.ready}
        _check_all_have_grads(self.module, ready)
        if self._next != len(self.buckets):
            raise RuntimeError("gradients arrived outside the last backward; call "
                               "finish_gradients after a backward run outside no_sync()")
        for _, pending in self._in_flight:
            pending.wait()
        self._in_flight.clear()
        for bucket in self.buckets:
            bucket.slice.set_grad(bucket.grad)
            bucket.ready.clear()
        self._next = 0
        self._step_done()

    # -- half parameters: what the optimizer steps is the buckets' fp32 masters ------------------

    def begin_step(self) -> None:
        """Before a step's first forward: the fp32 gradient sums start from zero (a skipped
        update, a non-finite norm, leaves last step's there)."""
        if self.masters:
            for bucket in self.buckets:
                bucket.grad.zero_()

    @torch.no_grad()
    def finish_step(self) -> None:
        """After the optimizer step: the masters rounded into the half parameters."""
        if self.masters:
            for bucket in self.buckets:
                bucket.slice.after_step()

    def optimizer_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if not self.masters:
            return super().optimizer_groups()
        return stepped_classes(self.buckets)[:2]

    def matrix_tensors(self) -> list[torch.Tensor]:
        if not self.masters:
            return super().matrix_tensors()
        return stepped_classes(self.buckets)[2]

    def param_groups(self) -> dict[str | None, list[torch.Tensor]]:
        if not self.masters:
            return super().param_groups()
        return stepped_by_group(self.buckets)

    def held_pieces(self) -> list[Piece]:
        if not self.masters:
            return super().held_pieces()
        return [piece for b in self.buckets for piece in b.held_pieces()]

    def grad_pieces(self):
        if not self.masters:
            yield from super().grad_pieces()
            return
        for b in self.buckets:
            yield from b.grad_pieces()

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Half parameters: the half buckets, their fp32 gradient sums, and the optimizer's
        state with the fp32 masters (ZeRO's accounting: 2 + 4 + (8 + 4) bytes per element)."""
        if not self.masters:
            return super().state_bytes(optimizer)
        return self._with_peak({
            "params": nbytes(b.full for b in self.buckets) + self.frozen_bytes(),
            "grads": nbytes(b.grad for b in self.buckets),
            "optimizer": optimizer_state_bytes(optimizer)
            + sum(b.slice.master_bytes for b in self.buckets),
        })
