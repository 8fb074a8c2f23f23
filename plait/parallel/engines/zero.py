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
that every slice belongs to one optimizer parameter group; nor are the matrices a matrix optimizer
(Muon) steps, whose slices it brings together whole (`optim/muon.py`).

Hybrid sharding (HSDP; the hpZ idea of ZeRO++, Wang et al. 2023): with a `replicate` axis, state
is sharded over the K ranks of `group` only, and the dp / K groups hold replicas of it. Each slice's
reduce-scattered gradient is then all-reduced over `replicate`; parameters are gathered within the
K ranks alone.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.comm import all_gather, all_reduce, reduce_scatter
from plait.comm.buckets import assign_buckets
from plait.comm.compression import Compression, replica_segment
from plait.mesh import Axis
from plait.parallel.engines.buffer_pool import BufferPool
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
    fill_unused,
    launch_ready,
    sync_classes,
)
from plait.parallel.engines.state import Piece, nbytes, optimizer_state_bytes


def flat_groups(named: list[tuple[str, nn.Parameter]], bucket_mb: float,
                matrices: frozenset[str] = frozenset(), groups: dict[str, str] | None = None):
    """(bucket members, decay, matrix, group): the optimizer's classes (`optimizer_classes`:
    Muon's matrices, other decay parameters, no-decay ones, each by the user's parameter group),
    each cut into buckets, never mixed."""
    return [(m, *kind) for members, *kind in optimizer_classes(named, matrices, groups)
            for m in assign_buckets(members, int(bucket_mb * 2**20))]


class ShardedEngine(SyncedReplicas):
    """What ZeRO-1/2 and ZeRO-3 share: flat parameters sharded over `shard` (K ranks), replicas
    across `replicate` (HSDP), the averaged gradient slices, the optimizer over slices."""

    def _init_sharding(self, module: nn.Module, dp_size: int, shard: Axis,
                       replicate: Axis | None, reduce_dtype: torch.dtype,
                       compression: Compression | None,
                       overrides: dict[str, Axis] | None,
                       matrices: frozenset[str] = frozenset(),
                       groups: dict[str, str] | None = None) -> None:
        self.module, self.reduce_dtype, self.compression = module, reduce_dtype, compression
        self.matrices = matrices  # what a matrix optimizer steps (flat buffers of their own)
        self.groups = groups or {}  # name -> the user's parameter group (buffers of their own)
        self.group, self.size, self.rank = shard.group, shard.size, shard.rank
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        self.dp_size = dp_size  # gradients are pre-divided by all of dp (x ep)
        self.storage_axis = shard
        self._inflight: list = []  # (flat, its reduce-scatter) of the group last launched
        self.peak_params = self.peak_grads = 0  # this step's, measured from `begin_step`
        self.overrides = overrides or {}  # name -> the axis sharding it, if not `shard`
        self.buffers = BufferPool()  # gradient staging (and ZeRO-3's gathered units), reused
        if any(p.is_meta for p in module.parameters()):
            return  # materialized slice by slice: equal replicas by construction
        _broadcast_replicas(module, shard.group,
                            {n: a.group for n, a in self.overrides.items()})
        if self.replicate is not None:
            _broadcast_replicas(module, self.replicate.group)

    @property
    def flats(self) -> list[FlatParam]:
        raise NotImplementedError

    def flat_buffers(self) -> list[FlatParam]:
        return self.flats

    def _reduce_grad(self, flat: FlatParam):
        """Start the reduce-scatter of a flat gradient into this rank's `grad_shard`."""
        if flat.grad_shard_memory is None:  # made once, reused every step
            flat.grad_shard_memory = torch.empty_like(flat.slice.shard, dtype=self.reduce_dtype)
        flat.grad_shard = flat.grad_shard_memory
        if self._compressing(flat.size) and self.replicate is None:  # hybrid: `_settle`'s
            return self.compression.method.reduce_scatter(
                flat.key, flat.grad, flat.grad_shard, flat.segments, flat.group)
        return reduce_scatter(flat.grad_shard, flat.grad, flat.group, async_op=True,
                              scratch=True)  # the staging is let go once reduced

    def _launch_group(self, flats: list[FlatParam]) -> None:
        """Start the reduce-scatters of a bucket (ZeRO-1/2) or a unit's flats (ZeRO-3), after
        settling those still in flight: at most one group's staging buffers are reducing while
        the next fills, so the gradient held during backward is the slices plus two groups'
        staging, not the whole model's (`predict.cost.state_bytes`: "peak")."""
        self._settle()
        self._inflight = [(f, self._reduce_grad(f)) for f in flats]
        self._note_peak()

    def _settle(self) -> None:
        """Wait for the reduce-scatters in flight; sum their slices over the replicas (HSDP);
        let go of their full-size staging buffers."""
        for flat, pending in self._inflight:
            pending.wait()
            if self.replicate is not None and self._compressing(self.replicate.size):
                self.compression.method.all_reduce(  # the slow links: compressed (hpZ's qgZ)
                    flat.key, flat.grad_shard, [replica_segment(flat.grad_shard.numel())],
                    self.replicate.group).wait()
            elif self.replicate is not None:
                all_reduce(flat.grad_shard, self.replicate.group)
            self.buffers.detach(flat.grad.untyped_storage())
            flat.grad = None  # the staging buffer
        self._inflight = []

    def _staging(self, flat: FlatParam) -> torch.Tensor:
        """A zeroed buffer the size of `flat` in the reduction dtype, for its gradient (reused
        from a group reduced earlier: `buffer_pool.py`)."""
        return self.buffers.zeros(flat.full.numel(), self.reduce_dtype, flat.full.device)

    def _hand_over(self) -> None:
        """After the step's last reduce-scatter: each slice gets its averaged gradient. The idle
        buffers go: the optimizer's step needs the memory more (AdamW's update makes a copy of
        the slices), and the next step makes the few it needs again."""
        self._settle()
        self.buffers.release_idle()
        for flat in self.flats:
            flat.slice.set_grad(flat.grad_shard)

    # -- the step's peak model state (what is alive at once during backward) -------------------

    def begin_step(self) -> None:
        """Before a step's first forward: last step's gradient slices are let go (the optimizer
        has used them), and the peak is measured from here."""
        for flat in self.flats:
            flat.grad_shard = None
        self.peak_params = self.peak_grads = 0
        self._note_peak()

    def _params_bytes(self) -> int:
        return nbytes(f.full for f in self.flats) + self.frozen_bytes()

    def _note_peak(self) -> None:
        """Record the parameter and gradient bytes alive now (called where either grows: a
        gradient arrives, a group is launched, ZeRO-3 gathers a unit): the parameters' storage,
        every gradient the engine holds (the parameters' own `.grad`, the staging buffers, the
        averaged slices)."""
        flats = self.flats
        grads = nbytes(p.grad for f in flats for p in f.params) + nbytes(f.grad for f in flats) \
            + nbytes(f.grad_shard for f in flats)
        self.peak_grads = max(self.peak_grads, grads)
        self.peak_params = max(self.peak_params, self._params_bytes())

    def _with_peak(self, state: dict[str, int]) -> dict[str, int]:
        """The end-of-step figures and "peak": the step's largest parameter bytes plus its
        largest gradient bytes plus the rest (optimizer state, compression state), which stay
        put during a step."""
        state = self._with_compression(state)
        rest = sum(v for k, v in state.items() if k not in ("params", "grads"))
        state["peak"] = self.peak_params + self.peak_grads + rest
        return state

    def optimizer_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The owned slices (or their masters), (decay, no_decay): what the optimizer steps
        elementwise (the matrices' slices are `matrix_tensors`)."""
        return stepped_classes(self.flats)[:2]

    def matrix_tensors(self) -> list[torch.Tensor]:
        return stepped_classes(self.flats)[2]

    def param_groups(self) -> dict[str | None, list[torch.Tensor]]:
        return stepped_by_group(self.flats)

    def held_pieces(self) -> list[Piece]:
        return [piece for flat in self.flats for piece in flat.held_pieces()]

    def grad_pieces(self):
        # From the slices' gradients on the device (the masters' copies may be in host memory,
        # which NCCL cannot reduce).
        for flat in self.flats:
            yield from flat.grad_pieces()


class ZeroDataParallel(ShardedEngine):
    """ZeRO stage 1 or 2 over `shard` (the dp axis, or its sharding groups under HSDP)."""

    def __init__(
        self,
        module: nn.Module,
        shard: Axis,
        stage: int,
        bucket_mb: float = 25.0,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        offload_optimizer: bool = False,
        replicate: Axis | None = None,
        compression: Compression | None = None,
        overrides: dict[str, Axis] | None = None,
        matrices: frozenset[str] = frozenset(),
        groups: dict[str, str] | None = None,
    ):
        super().__init__()
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel implements stages 1 and 2, got {stage}")
        self.stage = stage
        dp_size = shard.size * (replicate.size if replicate else 1)
        self._init_sharding(module, dp_size, shard, replicate, reduce_dtype, compression,
                            overrides, matrices, groups)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        # Offload: masters and optimizer state in host memory (a no-op when already on the CPU).
        master_device = torch.device("cpu") if offload_optimizer else None
        self.buckets: list[FlatParam] = [
            FlatParam(members, decay, axis.size, axis.rank, param_dtype, master_device,
                      group=axis.group, matrix=matrix, group_name=name)
            for axis, cls in sync_classes(named, shard, self.overrides)
            for members, decay, matrix, name in flat_groups(cls, bucket_mb, matrices, groups)
        ]
        self._next = 0
        self._hooks = {}  # (bucket, position) -> its hook
        for index, bucket in enumerate(self.buckets):
            for position, p in enumerate(bucket.params):
                hook = self._hooks[index, position] = self._hook(bucket, position)
                p.register_post_accumulate_grad_hook(hook)

    @property
    def flats(self) -> list[FlatParam]:
        return self.buckets

    def _hook(self, bucket: FlatParam, position: int):
        def on_gradient(p: nn.Parameter) -> None:
            if not self._sync:
                return
            if bucket.grad is None:
                bucket.grad = self._staging(bucket)
            self._note_peak()
            torch.div(p.grad, self.dp_size, out=bucket.view(bucket.grad, position))  # average
            if self.stage == 2:
                p.grad = None  # stage 1 keeps whole gradients, stage 2 only the slice
            bucket.ready.add(position)
            self._next = launch_ready(self.buckets, self._next, self._launch)

        return on_gradient

    def _launch(self, bucket: FlatParam) -> None:
        self._launch_group([bucket])

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """Wait for every bucket's reduce-scatter; the owned slices get their averaged gradient."""
        if self.zero_unused:
            fill_unused(self.buckets, self._hooks)
        _check_all_have_grads(self.module, {b.names[i] for b in self.buckets for i in b.ready})
        if self._next != len(self.buckets):
            raise RuntimeError("gradients arrived outside the last backward; call "
                               "finish_gradients after a backward run outside no_sync()")
        self._hand_over()
        for bucket in self.buckets:
            bucket.ready.clear()
        self._next = 0
        self._step_done()

    @torch.no_grad()
    def finish_step(self) -> None:
        """After the optimizer updated the owned slices: every rank gets every slice back."""
        for bucket in self.buckets:
            bucket.slice.after_step()
            # Gathered from a copy: the output must not alias the input slice.
            all_gather(bucket.full, bucket.slice.shard.clone(), bucket.group)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of model state this rank holds (padding included)."""
        if self.stage == 1:
            grads = [p.grad for b in self.buckets for p in b.params]
        else:
            grads = [b.grad_shard for b in self.buckets]
        return self._with_peak({
            "params": self._params_bytes(),
            "grads": nbytes(grads),
            "optimizer": optimizer_state_bytes(optimizer)
            + sum(b.slice.master_bytes for b in self.buckets),
        })
