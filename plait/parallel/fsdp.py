"""ZeRO stage 3 (Rajbhandari et al. 2020, P_os+g+p), what PyTorch calls fully sharded data
parallelism: parameters, gradients and optimizer state all held 1/N per rank of the `dp` axis.

The model is cut into units, executed in order: the embedding, each transformer block, the head
(final norm + output). At rest a unit is only this rank's fp32 slice of its flattened parameters
(padded to a multiple of N); the optimizer steps that slice.

    forward:  before the unit, all-gather it into a full buffer (the parameters are views of it)
              and start gathering the next unit (prefetch); after the unit, free the buffer.
    backward: when the gradient reaches the unit's output, gather it again (and prefetch the
              previous unit); once all its gradients have arrived, reduce-scatter them into this
              rank's slice and free the unit.

Freeing resizes the buffer's storage to zero rather than dropping the tensor, so the parameter
views (and what autograd saved of them) stay valid and are refilled in place by the next gather.
At most two units are gathered at once. Communication per step: two all-gathers and a
reduce-scatter of Psi elements, 1.5 times ZeRO-1/2's (section 7.2.2 of the paper).

Mixed precision (`param_dtype=torch.bfloat16`): the slices and the gathered units are bf16; fp32
masters of the slices are what the optimizer steps; gradients are reduce-scattered in
`reduce_dtype`. Offload (ZeRO-Offload / ZeRO-Infinity): "optimizer" keeps masters and optimizer
state in host memory, where the update runs; "params" keeps the slices there too, copied to the
device before each gather. On a CPU-only machine both change nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from plait.comm import Pending, all_gather, all_reduced, reduce_scatter
from plait.model.llama import Transformer
from plait.parallel.data_parallel import SyncedReplicas, _broadcast_replicas
from plait.parallel.state import Slice, nbytes, optimizer_state_bytes


class FlatShard:
    """Some parameters of one unit, flattened; `shard` persists, `full` only while gathered."""

    def __init__(self, members: list[tuple[str, nn.Parameter]], decay: bool, size: int, rank: int,
                 param_dtype: torch.dtype | None, offload: str):
        self.names = [n for n, _ in members]
        self.params = [p for _, p in members]
        self.decay = decay
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        shard_numel = -(-total // size)
        first = self.params[0]
        whole = torch.zeros(shard_numel * size, dtype=first.dtype, device=first.device)
        for p, view in zip(self.params, self.views(whole), strict=True):
            view.copy_(p.detach())
        mine = whole[rank * shard_numel : (rank + 1) * shard_numel]
        cpu = torch.device("cpu")
        shard = mine.to(device=cpu if offload == "params" else mine.device,
                        dtype=param_dtype or first.dtype, copy=True)
        self.slice = Slice(shard, first.dtype, cpu if offload != "none" else None)
        if self.slice.master is not self.slice.shard:
            self.slice.master.copy_(mine)  # the master keeps full precision from the start
        self.full = whole.to(param_dtype or first.dtype)
        for p, view in zip(self.params, self.views(self.full), strict=True):
            p.data = view  # the parameter is now a view of the (gatherable) full buffer
        self.grad: torch.Tensor | None = None  # full gradient, while being filled
        self.grad_shard: torch.Tensor | None = None
        self.ready: set[int] = set()

    def view(self, flat: torch.Tensor, position: int) -> torch.Tensor:
        """Parameter `position`'s slice of a flat tensor laid out like this group."""
        p, start = self.params[position], self.offsets[position]
        return flat[start : start + p.numel()].view_as(p)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [self.view(flat, i) for i in range(len(self.params))]

    @property
    def full_bytes(self) -> int:
        return self.full.numel() * self.full.element_size()


class Unit:
    """Modules that run one after another and are gathered and freed together."""

    def __init__(self, modules: list[nn.Module], names: dict[nn.Parameter, str], size: int,
                 rank: int, param_dtype: torch.dtype | None, offload: str):
        self.modules = modules
        named = [(names[p], p) for m in modules for p in m.parameters()]
        self.flats = [FlatShard([(n, p) for n, p in named if (p.dim() >= 2) == decay], decay,
                                size, rank, param_dtype, offload)
                      for decay in (True, False)
                      if any((p.dim() >= 2) == decay for _, p in named)]
        self.gathered = True  # built from whole parameters
        self.pending: list[Pending] = []  # all-gathers in flight
        self.reducing: list[Pending] = []  # reduce-scatters in flight
        self.reduced = False  # this step's gradients are on their way to the slices

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for f in self.flats for p in f.params]


class FullyShardedDataParallel(SyncedReplicas):
    """ZeRO-3 over `group` (the `dp` axis), for a `plait.model.Transformer`."""

    def __init__(
        self,
        model: Transformer,
        group: ProcessGroup,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        offload: str = "none",
    ):
        super().__init__()
        self.module, self.group, self.reduce_dtype = model, group, reduce_dtype
        self.size, rank = dist.get_world_size(group), dist.get_rank(group)
        _broadcast_replicas(model, group)
        names = {p: n for n, p in model.named_parameters()}
        parts = [[model.tok_embeddings], *([b] for b in model.layers.values()),
                 [model.norm, model.output]]
        self.units = [Unit(modules, names, self.size, rank, param_dtype, offload)
                      for modules in parts]
        # Every unit starts gathered (built from whole parameters) and is freed just below.
        self.gathered_bytes = sum(f.full_bytes for u in self.units for f in u.flats)
        self.peak_gathered_bytes = 0  # measured from the first step on
        for index, unit in enumerate(self.units):
            self._free(unit)
            unit.modules[0].register_forward_pre_hook(self._pre_forward(index))
            unit.modules[-1].register_forward_hook(self._post_forward(index))
            for flat in unit.flats:
                for position, p in enumerate(flat.params):
                    p.register_post_accumulate_grad_hook(self._on_grad(unit, flat, position))

    @property
    def buckets(self) -> list[FlatShard]:
        """The flat groups of every unit, in execution order (as `ZeroDataParallel.buckets`)."""
        return [f for u in self.units for f in u.flats]

    # -- gathering and freeing ------------------------------------------------------------------

    def _gather(self, unit: Unit) -> None:
        """Start the all-gather of `unit` (no-op if gathered or on its way)."""
        if unit.gathered or unit.pending:
            return
        for flat in unit.flats:
            flat.full.untyped_storage().resize_(flat.full_bytes)
            shard = flat.slice.shard.to(flat.full.device, non_blocking=True)  # offloaded: H2D
            unit.pending.append(all_gather(flat.full, shard, self.group, async_op=True))
        self.gathered_bytes += sum(f.full_bytes for f in unit.flats)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _wait(self, unit: Unit) -> None:
        self._gather(unit)
        for p in unit.pending:
            p.wait()
        unit.pending.clear()
        unit.gathered = True

    def _free(self, unit: Unit) -> None:
        if unit.gathered:
            for flat in unit.flats:
                flat.full.untyped_storage().resize_(0)
            unit.gathered = False
            self.gathered_bytes -= sum(f.full_bytes for f in unit.flats)

    # -- hooks ----------------------------------------------------------------------------------

    def _pre_forward(self, index: int):
        def hook(module, args):
            self._wait(self.units[index])
            if index + 1 < len(self.units):
                self._gather(self.units[index + 1])  # prefetch the next unit

        return hook

    def _post_forward(self, index: int):
        unit = self.units[index]

        def hook(module, args, output):
            self._free(unit)
            if output.requires_grad:  # before this unit's backward: gather it again
                output.register_hook(self._pre_backward(index))

        return hook

    def _pre_backward(self, index: int):
        def hook(grad):
            self._wait(self.units[index])
            if index > 0:
                self._gather(self.units[index - 1])  # prefetch the previous unit
            return grad

        return hook

    def _on_grad(self, unit: Unit, flat: FlatShard, position: int):
        def on_gradient(p: nn.Parameter) -> None:
            if self._sync:
                if flat.grad is None:
                    flat.grad = torch.zeros(flat.full.numel(), dtype=self.reduce_dtype,
                                            device=p.device)
                torch.div(p.grad, self.size, out=flat.view(flat.grad, position))
                p.grad = None  # the flat gradient holds it now
            flat.ready.add(position)
            if all(len(f.ready) == len(f.params) for f in unit.flats):  # the unit is done
                if self._sync:
                    for f in unit.flats:
                        f.grad_shard = torch.empty_like(f.slice.shard, dtype=self.reduce_dtype)
                        unit.reducing.append(
                            reduce_scatter(f.grad_shard, f.grad, self.group, async_op=True))
                    unit.reduced = True
                for f in unit.flats:
                    f.ready.clear()
                self._free(unit)

        return on_gradient

    # -- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """Wait for every unit's reduce-scatter; the slices get their averaged gradients."""
        late = [n for u in self.units if not u.reduced for f in u.flats
                for i, n in enumerate(f.names) if i not in f.ready]
        if late:
            raise RuntimeError(
                f"parameters got no gradient this step: {', '.join(late)}; every parameter must "
                "take part in the loss, and finish_gradients follow a backward outside no_sync()"
            )
        for unit in self.units:
            for pending in unit.reducing:
                pending.wait()
            unit.reducing.clear()
            unit.reduced = False
            for flat in unit.flats:
                flat.slice.set_grad(flat.grad_shard)
                flat.grad = None

    def finish_step(self) -> None:
        """Nothing to gather (the next forward gathers each unit from its updated slice); under
        mixed precision, round the masters into the bf16 slices."""
        for flat in self.buckets:
            flat.slice.after_step()

    def optimizer_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        flats = self.buckets
        return ([f.slice.master for f in flats if f.decay],
                [f.slice.master for f in flats if not f.decay])

    def grad_norm_sq(self) -> torch.Tensor:
        # From the slices' gradients on the device (the masters' copies may be in host memory,
        # which NCCL cannot reduce).
        local = sum(b.grad_shard.double().pow(2).sum() for b in self.buckets)
        return all_reduced(torch.as_tensor(local).reshape(1), self.group)[0]

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        flats = self.buckets
        return {
            "params": nbytes(f.slice.shard for f in flats) + self.gathered_bytes,
            "grads": nbytes(f.grad_shard for f in flats),
            "optimizer": optimizer_state_bytes(optimizer)
            + sum(f.slice.master_bytes for f in flats),
        }

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole (gathers each unit once): for checkpoints and tests."""
        out = {}
        for unit in self.units:
            self._wait(unit)
            for flat in unit.flats:
                for name, view in zip(flat.names, flat.views(flat.full), strict=True):
                    out[name] = view.clone()
            self._free(unit)
        return out
