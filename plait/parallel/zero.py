"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", section 5): data parallelism in which each of the N ranks of the `dp`
axis keeps the optimizer state of only 1/N of the parameters.

Parameters live in flat buckets (`comm.buckets` order: reverse registration, about
`bucket_mb` each), each padded to a multiple of N elements; rank r owns slice r of every bucket.
As backward fills a bucket, its gradients (pre-divided by N) are reduce-scattered, so rank r
receives the averaged gradient of its slice only. The optimizer updates the owned slices (views of
the flat parameters); `finish_step` all-gathers the updated slices back into every replica.
Communication per step: a reduce-scatter and an all-gather of Psi elements, the cost of one
all-reduce (section 7.2.1).

- Stage 1 (P_os): parameters and gradients whole on every rank; optimizer state 1/N.
- Stage 2 (P_os+g): as stage 1, but each parameter lets go of its gradient as soon as it has been
  copied into its bucket for the reduce-scatter: gradients 1/N.

Mixed precision (`param_dtype=torch.bfloat16`): parameters are held, computed with and gathered in
bf16; each rank keeps fp32 master copies of its slices, which the optimizer steps (ZeRO's
2 + 2 + K bytes per parameter, K = 12: master, two moments). `reduce_dtype` is the dtype of the
gradient reduce-scatter.

Decay (matrices, embeddings) and no-decay (norm gains) parameters are never mixed in a bucket, so
that every slice belongs to one optimizer parameter group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from plait.comm import Pending, all_gather, all_reduced, reduce_scatter
from plait.comm.buckets import assign_buckets
from plait.parallel.data_parallel import (
    SyncedReplicas,
    _broadcast_replicas,
    _check_all_have_grads,
    launch_ready,
)
from plait.parallel.state import Slice, nbytes, optimizer_state_bytes


@dataclass
class FlatBucket:
    """Parameters stored back to back in `data` (padded to a multiple of N); slice r is rank r's."""

    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    data: torch.Tensor  # (N * shard_numel,) the parameters' storage
    slice: Slice  # this rank's slice of `data` (a view) and what the optimizer steps for it
    decay: bool
    grad: torch.Tensor | None = None  # (N * shard_numel,) staging for the reduce-scatter
    grad_shard: torch.Tensor | None = None  # this rank's averaged gradient slice
    ready: set[int] = field(default_factory=set)
    pending: Pending | None = None

    def view(self, flat: torch.Tensor, position: int) -> torch.Tensor:
        p, start = self.params[position], self.offsets[position]
        return flat[start : start + p.numel()].view_as(p)


def _flatten(members, decay: bool, size: int, rank: int, param_dtype, master_device) -> FlatBucket:
    offsets, total = [], 0
    for _, p in members:
        offsets.append(total)
        total += p.numel()
    shard_numel = -(-total // size)  # ceil
    first = members[0][1]
    full = torch.zeros(shard_numel * size, dtype=first.dtype, device=first.device)
    for (_, p), start in zip(members, offsets, strict=True):
        full[start : start + p.numel()].copy_(p.detach().reshape(-1))
    mine = slice(rank * shard_numel, (rank + 1) * shard_numel)
    data = full.to(param_dtype or first.dtype)
    bucket = FlatBucket([n for n, _ in members], [p for _, p in members], offsets, data,
                        Slice(data[mine], first.dtype, master_device), decay)
    if bucket.slice.master is not bucket.slice.shard:
        bucket.slice.master.copy_(full[mine])  # the master keeps full precision from the start
    for position, p in enumerate(bucket.params):
        p.data = bucket.view(data, position)  # the parameter now lives in the flat bucket
    return bucket


class ZeroDataParallel(SyncedReplicas):
    """ZeRO stage 1 or 2 over `group` (the `dp` axis). Interface of `DataParallel`, plus
    `optimizer_groups()` (what the optimizer must own) and `finish_step()` (after it stepped)."""

    def __init__(
        self,
        module: nn.Module,
        group: ProcessGroup,
        stage: int,
        bucket_mb: float = 25.0,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        offload_optimizer: bool = False,
    ):
        super().__init__()
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel implements stages 1 and 2, got {stage}")
        self.module, self.group, self.stage = module, group, stage
        self.reduce_dtype = reduce_dtype
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        _broadcast_replicas(module, group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        # Offload: masters and optimizer state in host memory (a no-op when already on the CPU).
        master_device = torch.device("cpu") if offload_optimizer else None
        self.buckets: list[FlatBucket] = []
        for decay in (True, False):
            members = [(n, p) for n, p in named if (p.dim() >= 2) == decay]
            for group_members in assign_buckets(members, int(bucket_mb * 2**20)) if members else []:
                self.buckets.append(_flatten(group_members, decay, self.size, self.rank,
                                             param_dtype, master_device))
        self._next = 0
        for bucket in self.buckets:
            for position, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(self._hook(bucket, position))

    def optimizer_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The owned slices (or their masters), (decay, no_decay): what the optimizer steps."""
        return ([b.slice.master for b in self.buckets if b.decay],
                [b.slice.master for b in self.buckets if not b.decay])

    def _hook(self, bucket: FlatBucket, position: int):
        def on_gradient(p: nn.Parameter) -> None:
            if not self._sync:
                return
            if bucket.grad is None:
                bucket.grad = torch.zeros_like(bucket.data, dtype=self.reduce_dtype)
            torch.div(p.grad, self.size, out=bucket.view(bucket.grad, position))  # average
            if self.stage == 2:
                p.grad = None  # stage 1 keeps whole gradients, stage 2 only the slice
            bucket.ready.add(position)
            self._next = launch_ready(self.buckets, self._next, self._launch)

        return on_gradient

    def _launch(self, bucket: FlatBucket) -> None:
        bucket.grad_shard = torch.empty_like(bucket.slice.shard, dtype=self.reduce_dtype)
        bucket.pending = reduce_scatter(bucket.grad_shard, bucket.grad, self.group, async_op=True)

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """Wait for every bucket's reduce-scatter; the owned slices get their averaged gradient."""
        _check_all_have_grads(self.module, {b.names[i] for b in self.buckets for i in b.ready})
        if self._next != len(self.buckets):
            raise RuntimeError("gradients arrived outside the last backward; call "
                               "finish_gradients after a backward run outside no_sync()")
        for bucket in self.buckets:
            bucket.pending.wait()
            bucket.slice.set_grad(bucket.grad_shard)
            bucket.grad = None  # the staging buffer
            bucket.ready.clear()
        self._next = 0

    @torch.no_grad()
    def finish_step(self) -> None:
        """After the optimizer updated the owned slices: every rank gets every slice back."""
        for bucket in self.buckets:
            bucket.slice.after_step()
            # Gathered from a copy: the output must not alias the input slice.
            all_gather(bucket.data, bucket.slice.shard.clone(), self.group)

    def grad_norm_sq(self) -> torch.Tensor:
        """Squared norm of the whole averaged gradient: each rank's slices, summed over ranks."""
        # From the slices' gradients on the device (the masters' copies may be in host memory,
        # which NCCL cannot reduce).
        local = sum(b.grad_shard.double().pow(2).sum() for b in self.buckets)
        return all_reduced(torch.as_tensor(local).reshape(1), self.group)[0]

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of model state this rank holds (padding included)."""
        if self.stage == 1:
            grads = [p.grad for b in self.buckets for p in b.params]
        else:
            grads = [b.grad_shard for b in self.buckets]
        return {
            "params": nbytes(b.data for b in self.buckets),
            "grads": nbytes(grads),
            "optimizer": optimizer_state_bytes(optimizer)
            + sum(b.slice.master_bytes for b in self.buckets),
        }
