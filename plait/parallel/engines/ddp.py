"""Data parallelism with whole replicas (DDP) on the ranks of the `dp` axis, gradients averaged;
the interface every engine shares is `replicas.SyncedReplicas`.

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

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from plait.comm import Pending, all_reduce
from plait.comm.allreduce import AllReduceAlgorithm, NodeGroups, all_reduce_by
from plait.comm.buckets import assign_buckets
from plait.comm.compression import Compression
from plait.parallel.engines.flat import (
    FlatParam,
    optimizer_classes,
    stepped_by_group,
    stepped_classes,
)
from plait.parallel.engines.replicas import (
    SyncedReplicas,
    _broadcast_replicas,
    _check_all_have_grads,
    _zero_grads,
    fill_unused,
    launch_ready,
    sync_classes,
)
from plait.parallel.engines.state import Piece, nbytes, optimizer_state_bytes


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
