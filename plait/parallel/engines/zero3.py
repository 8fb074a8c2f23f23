"""ZeRO stage 3 (Rajbhandari et al. 2020, P_os+g+p), what PyTorch calls fully sharded data
parallelism: parameters, gradients and optimizer state all held 1/N per rank of the `dp` axis.

The model (or this pipeline stage's chunks of it) is cut into units, executed in order: the
embedding, each transformer block, the head (final norm + output), as its plan names them; a
model with no plan, by a wrap policy (`wrap.py`): what the policy leaves over first (gathered for
the whole forward), then each module it chooses. At rest a unit is only this
rank's fp32 slice of its flattened parameters (`flat.FlatParam`, padded to a multiple of N); the
optimizer steps that slice.

    forward:  before the unit, all-gather it into a full buffer (the parameters are views of it)
              and start gathering the next unit (prefetch); after the unit, free the buffer.
    backward: when the gradient reaches the unit's output, gather it again (and prefetch the
              previous unit); once all its gradients have arrived, reduce-scatter them into this
              rank's slice and free the unit.

Freeing resizes the buffer's storage to zero rather than dropping the tensor, so the parameter
views (and what autograd saved of them) stay valid and are refilled in place by the next gather.
At most two units are gathered at once (a wrap policy's leftover unit, or tied embeddings', beside
them); `max_live` (`parallel.max_live_params`, DeepSpeed's `stage3_max_live_parameters`) bounds
the elements a prefetch may bring the gathered units to: a unit beyond it is gathered when it
runs, not before, trading the overlap of its gather for its memory. Communication per step: two
all-gathers and a reduce-scatter of Psi elements, 1.5 times ZeRO-1/2's (section 7.2.2 of the paper).

`reshard_after_forward=False` (FSDP's name for it) keeps each unit gathered from its first use in
a step until its gradients are reduce-scattered, instead of freeing it after every forward and
backward: across M micro-batches (gradient accumulation, or a pipeline's schedule) one all-gather
per unit and step instead of 2M, for the memory of whole units held between micro-batches.

Activation checkpointing recomputes a block's forward during its backward; a unit in its backward
is neither prefetched past nor freed by that recomputation.

Mixed precision (`param_dtype=torch.bfloat16`): the slices and the gathered units are bf16; fp32
masters of the slices are what the optimizer steps; gradients are reduce-scattered in
`reduce_dtype`. Offload (ZeRO-Offload / ZeRO-Infinity): "optimizer" keeps masters and optimizer
state in host memory, where the update runs; "params" keeps the slices there too, copied to the
device before each gather. On a CPU-only machine both change nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.comm import Pending, all_gather
from plait.comm.compression import Compression
from plait.host_memory import give_back_freed
from plait.mesh import Axis
from plait.model.materialize import materialize, swap_parameters
from plait.parallel.activation_checkpoint import recomputing
from plait.parallel.batch import tensors_in
from plait.parallel.engines.flat import FlatParam, optimizer_classes
from plait.parallel.engines.replicas import sync_classes
from plait.parallel.engines.state import nbytes, optimizer_state_bytes
from plait.parallel.engines.units import unit_modules, unit_params
from plait.parallel.engines.zero import ShardedEngine
from plait.parallel.wrap import WrapPolicy


class Unit:
    """Modules that run one after another and are gathered and freed together: one flat
    parameter per sync class (`sync_classes`) and decay group."""

    def __init__(self, modules: list[nn.Module], params: list[nn.Parameter],
                 names: dict[nn.Parameter, str], chunk: int, shard: Axis,
                 overrides: dict[str, Axis], flat_args: tuple, fill=None,
                 matrices: frozenset[str] = frozenset(), groups: dict[str, str] | None = None):
        self.modules, self.chunk = modules, chunk
        named = [(names[p], p) for p in params]
        self.flats = [FlatParam(members, decay, axis.size, axis.rank, *flat_args,
                                group=axis.group, fill=fill, matrix=matrix, group_name=name)
                      for axis, cls in sync_classes(named, shard, overrides)
                      for members, decay, matrix, name in optimizer_classes(cls, matrices,
                                                                            groups)]
        # Built from whole parameters; from `meta` ones (`fill`), only the slices exist.
        self.gathered = not any(f.replaced for f in self.flats)
        self.pending: list[Pending] = []  # all-gathers in flight
        self.versions = None  # the buffers' version counters before the gather in flight
        self.reduced = False  # this step's gradients are on their way to the slices
        self.ran = False  # its module's forward ran this step (it was gathered for it)
        self.numel = sum(f.full.numel() for f in self.flats)  # gathered, padding included


def _versions(unit: Unit):
    """The version counters of a unit's buffers now, to be put back once its gather is over
    (`with` the returned object around the wait): the gather writes the values the unit had when a
    forward saved them for backward, and gloo counts its writes when the transfer completes, in
    its own thread, so the counters the parameter views share with the buffers would move, and
    autograd would refuse those saved tensors (FSDP2 does the same for its all-gather outputs).
    Where saved tensors are packed by hooks (the trainer's activation count) autograd checks no
    versions at all, which is why only a step outside the trainer (`--verify`) met it."""
    return torch.autograd._unsafe_preserve_version_counter(tuple(f.full for f in unit.flats))


class Zero3DataParallel(ShardedEngine):
    """ZeRO-3 over `shard` (the dp axis, or its sharding groups under HSDP), for a model or a
    pipeline stage's chunks (`chunks`: a ModuleDict keyed by chunk index, in execution order)."""

    def __init__(
        self,
        chunks: nn.ModuleDict,
        shard: Axis,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        offload: str = "none",
        replicate: Axis | None = None,
        reshard_after_forward: bool = True,
        compression: Compression | None = None,
        overrides: dict[str, Axis] | None = None,
        wrap: WrapPolicy | None = None,
        max_live: int = 0,
        fill=None,
        matrices: frozenset[str] = frozenset(),
        groups: dict[str, str] | None = None,
    ):
        super().__init__()
        dp_size = shard.size * (replicate.size if replicate else 1)
        self._init_sharding(chunks, dp_size, shard, replicate, reduce_dtype, compression,
                            overrides, matrices, groups)
        self.reshard_after_forward = reshard_after_forward
        self.max_live = max_live  # parameter elements gathered at most by a prefetch (0: any)
        names = {p: n for n, p in chunks.named_parameters()}
        cpu = torch.device("cpu")
        flat_args = (param_dtype, cpu if offload != "none" else None, True,
                     cpu if offload == "params" else None)
        self.units = []
        for c, chunk in enumerate(chunks.values()):
            modules = unit_modules(chunk, wrap)
            for m, params in zip(modules, unit_params(modules), strict=True):
                params = [p for p in params if p.requires_grad]  # frozen: whole, as elsewhere
                if not params:
                    continue
                self.units.append(Unit(m, params, names, c, shard, self.overrides, flat_args,
                                       fill, matrices, groups))
                if fill is not None:  # what drawing its slices freed goes back to the kernel
                    give_back_freed()
        # A model built on `meta`: its parameters become views of the flat buffers, the frozen
        # ones what this rank holds of them, whole.
        swap_parameters(chunks, {k: v for f in self.flats for k, v in f.replaced.items()})
        if fill is not None:
            materialize(chunks, fill.record, fill.source)
        # A unit built from whole parameters starts gathered, and is freed just below.
        self.gathered_bytes = sum(f.full_bytes for u in self.units if u.gathered
                                  for f in u.flats)
        self.gathered_numel = sum(u.numel for u in self.units if u.gathered)
        self.peak_gathered_bytes = 0  # measured from the first step on
        for index, unit in enumerate(self.units):
            self._free(unit)
            unit.modules[0].register_forward_pre_hook(self._pre_forward(index))
            unit.modules[-1].register_forward_hook(self._post_forward(index))
            for flat in unit.flats:
                for position, p in enumerate(flat.params):
                    p.register_post_accumulate_grad_hook(self._on_grad(unit, flat, position))

    @property
    def flats(self) -> list[FlatParam]:
        """The flat groups of every unit, in execution order."""
        return [f for u in self.units for f in u.flats]

    buckets = flats

    def _neighbour(self, index: int, step: int) -> Unit | None:
        """The unit run just before or after, if it is in the same chunk (prefetch does not cross
        chunks: a pipeline runs other chunks and micro-batches in between)."""
        other = index + step
        if 0 <= other < len(self.units) and self.units[other].chunk == self.units[index].chunk:
            return self.units[other]
        return None

    # -- gathering and freeing ------------------------------------------------------------------

    def _gather(self, unit: Unit) -> None:
        """Start the all-gather of `unit` (no-op if gathered or on its way)."""
        if unit.gathered or unit.pending:
            return
        unit.versions = _versions(unit)  # before the gather writes
        for flat in unit.flats:
            self.buffers.attach(flat.full.untyped_storage(), flat.full_bytes)
            shard = flat.slice.shard.to(flat.full.device, non_blocking=True)  # offloaded: H2D
            unit.pending.append(all_gather(flat.full, shard, flat.group, async_op=True))
        self.gathered_bytes += sum(f.full_bytes for f in unit.flats)
        self.gathered_numel += unit.numel
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        self._note_peak()

    def _wait(self, unit: Unit) -> None:
        self._gather(unit)
        if unit.pending:
            with unit.versions:  # the counters as they were before the gather
                for p in unit.pending:
                    p.wait()
            unit.pending.clear()
        unit.gathered = True

    def _free(self, unit: Unit) -> None:
        if unit.gathered:
            for flat in unit.flats:
                self.buffers.detach(flat.full.untyped_storage())
            unit.gathered = False
            self.gathered_bytes -= sum(f.full_bytes for f in unit.flats)
            self.gathered_numel -= unit.numel

    def _prefetch(self, unit: Unit | None) -> None:
        """Start gathering `unit` ahead of its use, unless that would hold more than `max_live`
        parameter elements gathered at once (then its own hook gathers it when it runs)."""
        if unit is None or unit.gathered or unit.pending:
            return
        if self.max_live and self.gathered_numel + unit.numel > self.max_live:
            return
        self._gather(unit)

    # -- hooks ----------------------------------------------------------------------------------

    def _pre_forward(self, index: int):
        unit = self.units[index]

        def hook(module, args):
            unit.ran = True
            self._wait(unit)
            if not recomputing():  # the backward runs the other way
                self._prefetch(self._neighbour(index, +1))

        return hook

    def _post_forward(self, index: int):
        unit = self.units[index]

        def hook(module, args, output):
            if recomputing():  # activation checkpointing, inside this unit's backward
                return
            if self.reshard_after_forward or not torch.is_grad_enabled():
                self._free(unit)
            for t in tensors_in(output):  # before this unit's backward: gather it again
                if t.requires_grad:
                    t.register_hook(self._pre_backward(index))

        return hook

    def _pre_backward(self, index: int):
        unit = self.units[index]

        def hook(grad):
            self._wait(unit)
            previous = self._neighbour(index, -1)
            # Prefetch the previous unit, unless its backward is over (the leftover unit of a
            # model with no plan runs first and last: its gradients may be reduced already).
            if previous is not None and not previous.reduced:
                self._prefetch(previous)
            return grad

        return hook

    def _on_grad(self, unit: Unit, flat: FlatParam, position: int):
        def on_gradient(p: nn.Parameter) -> None:
            if not (unit.ran and unit.gathered):
                state = "is not gathered" if unit.ran else "never ran"
                raise RuntimeError(
                    f"ZeRO-3: {flat.names[position]} got a gradient, but its unit "
                    f"({type(unit.modules[0]).__name__}) {state}: the parameter is used outside "
                    "its module's forward (a unit is gathered only while its module runs); "
                    "choose a wrap policy whose units contain the modules that use it")
            if self._sync:
                if flat.grad is None:  # the unit's first gradient: stage all of its flats
                    for f in unit.flats:
                        f.grad = self._staging(f)
                self._note_peak()
                torch.div(p.grad, self.dp_size, out=flat.view(flat.grad, position))
                p.grad = None  # the flat gradient holds it now
            flat.ready.add(position)
            if all(len(f.ready) == len(f.params) for f in unit.flats):  # the unit is done
                if self._sync:
                    self._launch_group(unit.flats)
                    unit.reduced = True
                for f in unit.flats:
                    f.ready.clear()
                if self.reshard_after_forward or self._sync:
                    self._free(unit)

        return on_gradient

    # -- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """Wait for the last reduce-scatter; the slices get their averaged gradients."""
        if self.zero_unused and self._sync:
            self._fill_unused()
        late = [n for u in self.units if not u.reduced for f in u.flats
                for i, n in enumerate(f.names) if i not in f.ready]
        if late:
            raise RuntimeError(
                f"parameters got no gradient this step: {', '.join(late)}; every parameter must "
                "take part in the loss, and finish_gradients follow a backward outside no_sync()"
            )
        self._hand_over()
        for unit in self.units:
            unit.reduced = unit.ran = False
        self._step_done()

    def _fill_unused(self) -> None:
        """Each unit not reduced yet gets a gradient for every position none reached: zero, or
        what micro-batches before the last left in the parameter; then its reduce-scatter, unit
        by unit in order (every rank's backward reduced the same units before)."""
        for unit in self.units:
            if unit.reduced:
                continue
            if all(f.grad is None for f in unit.flats):
                for f in unit.flats:
                    f.grad = self._staging(f)
            for flat in unit.flats:
                for position, p in enumerate(flat.params):
                    if position in flat.ready:
                        continue
                    view = flat.view(flat.grad, position)
                    if p.grad is None:
                        view.zero_()
                    else:
                        torch.div(p.grad, self.dp_size, out=view)
                        p.grad = None
                    flat.ready.add(position)
            self._note_peak()
            self._launch_group(unit.flats)
            unit.reduced = True
            for f in unit.flats:
                f.ready.clear()
            self._free(unit)

    def finish_step(self) -> None:
        """Nothing to gather (the next forward gathers each unit from its updated slice); under
        mixed precision, round the masters into the bf16 slices. A unit still gathered holds
        the values before the step: it is freed."""
        for unit in self.units:
            if unit.pending:
                self._wait(unit)
            self._free(unit)
        for flat in self.flats:
            flat.slice.after_step()

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        flats = self.flats
        return self._with_peak({
            "params": self._params_bytes(),
            "grads": nbytes(f.grad_shard for f in flats),
            "optimizer": optimizer_state_bytes(optimizer)
            + sum(f.slice.master_bytes for f in flats),
        })

    def _params_bytes(self) -> int:
        """The slices, the units gathered now and the frozen parameters (whole)."""
        return nbytes(f.slice.shard for f in self.flats) + self.gathered_bytes + \
            self.frozen_bytes()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter this rank's stage holds, whole (gathers each unit once)."""
        out = {}
        for unit in self.units:
            was_gathered = unit.gathered
            self._wait(unit)
            for flat in unit.flats:
                for name, view in zip(flat.names, flat.views(flat.full), strict=True):
                    out[name] = view.clone()
            if not was_gathered:
                self._free(unit)
        out.update({piece.name: piece.tensor.detach().clone() for piece in self.frozen_pieces()})
        return out
