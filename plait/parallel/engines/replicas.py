"""What every data-parallel engine shares: replicas of the model on the ranks of the `dp` axis,
gradients averaged.

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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed import ProcessGroup

from plait.comm import broadcast
from plait.comm.compression import Compression
from plait.parallel.engines.state import Piece, model_state_bytes, nbytes


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
