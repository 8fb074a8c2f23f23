"""plait from Python: any `nn.Module`, the user's batches and loss, plait's parallelisms.

    import plait
    device = plait.init()                            # the world torchrun / `plait run` made
    job = plait.prepare(model, loss_fn, plait.ParallelConfig(zero=3),
                        wrap=plait.WrapPolicy(classes=(Block,)))
    optimizer = torch.optim.AdamW(job.parameters(), lr=1e-3)
    for inputs, targets in batches:                  # the global batch, the same on every rank
        loss = job.step(*job.local(inputs, targets), optimizer, grad_clip=1.0)
    job.save("ckpt", optimizer, step)                # sharded (DCP); any layout loads it

`prepare` runs the same straight line as `plait train` (`plait.parallel.parallelize`) and
`job.step` is the trainer's step (`Parallelized.step`). A model with no plan gets the
data-parallel engines: DDP, ZeRO-1/2, ZeRO-3 (units by `wrap`), HSDP, activation checkpointing of
the modules `checkpoint` names, accumulation over micro-batches, bf16, clipping. With a plan (one
of plait's, or one the user writes: `plait.ModelPlan`) tp, pp, cp and ep work too. A degree that
needs a plan the model lacks raises `ValueError` naming both, before any communication.

Persistent buffers (BatchNorm's running statistics) follow torch DDP's rule: each step they are
broadcast from the first rank of the data-parallel group before the forward. A parameter that
gets no gradient in a step is named in the error.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import shutil
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from plait import checkpoint as ckpt
from plait.checkpoint import rank_state
from plait.checkpoint.layout import SaveBoxes
from plait.comm import LEDGER, all_reduce, barrier, broadcast
from plait.config.checks_layout import validate_parallel
from plait.config.schema import ParallelConfig
from plait.mesh import build_mesh, rows_share, world_axis
from plait.model.plan import check_plan
from plait.optim.loss_scaling import HALF, LossScaler
from plait.optim.muon import MatrixExchange
from plait.optim.whole_matrices import Factory, WholeMatrices
from plait.parallel import Options, Parallelized, cross_entropy, parallelize
from plait.parallel.batch import Call, as_microbatches
from plait.parallel.compile import apply_compile, compile_enabled
from plait.parallel.wrap import WrapPolicy
from plait.predict.activation_memory import SavedActivations
from plait.train.run import worker_device
from plait.train.verify import Verdict, verify_step


def init(device: str = "auto", threads: int = 1, timeout_s: float = 300.0) -> torch.device:
    """Join the world the environment describes (torchrun's or `plait run`'s RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT; without them a world of one): gloo on CPU, NCCL on GPUs, `threads`
    intra-op threads per process (oversubscribed cores are ruinous). Returns this rank's device."""

    torch.set_num_threads(threads)
    where = worker_device(device)
    if not dist.is_initialized():
        backend = "nccl" if where.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
    return where


def print0(*args, **kwargs) -> None:
    """`print` on rank 0 alone (flushed)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def finish() -> None:
    """Leave the world (the end of a script)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class Prepared:
    """A model with plait's parallelisms applied: `parameters()` for the optimizer, `local()`
    for this rank's rows of a global batch, `step()` for one optimizer step, `model` to
    evaluate (one pipeline stage), `save()` / `load()` for sharded checkpoints."""

    def __init__(self, parallelized: Parallelized, microbatches: int, config: ParallelConfig,
                 loss_fn: Callable, reference: nn.Module | None = None, own_loss: bool = False):
        self.parallelized, self.microbatches, self.config = parallelized, microbatches, config
        self.rows_rank, self.rows = rows_share(parallelized.axes)
        self.loss_fn, self.reference = loss_fn, reference
        self.own_loss = own_loss  # no loss_fn given: in the batch form, the model's own loss
        self.world = world_axis()  # every rank: a checkpoint's barriers, --verify's verdict
        self._steps = 0

    @property
    def model(self) -> nn.Module:
        """This rank's module (the user's, in place; with a plan and pp > 1, a chunk of it)."""
        chunks = list(self.parallelized.module.values())
        return chunks[0] if len(chunks) == 1 else self.parallelized.module

    def parameters(self) -> list[torch.Tensor]:
        """What the optimizer steps on this rank: whole parameters (DDP), or this rank's slices
        of flattened parameters (ZeRO), fp32 masters under bf16 or fp16."""
        decay, no_decay = self.parallelized.optimizer_groups()
        return decay + no_decay

    def local(self, *batch: torch.Tensor) -> tuple[torch.Tensor, ...] | torch.Tensor:
        """This rank's rows of each global-batch tensor (dim 0, split over the data-parallel
        ranks); under context parallelism also its part of each sequence."""
        out = []
        for t in batch:
            if len(t) % self.rows:
                raise ValueError(f"a global batch of {len(t)} rows does not split over "
                                 f"{self.rows} data-parallel ranks; use a multiple")
            out.append(self.parallelized.context.shard(t.chunk(self.rows)[self.rows_rank]))
        return tuple(out) if len(out) > 1 else out[0]

    def step(self, *args, grad_clip: float = 0.0) -> float:
        """One optimizer step, in either form:

        - `job.step(batch, optimizer)`: `batch` is the global batch as the model takes it, the
          same on every rank: a tensor (`model(batch)`), a tuple (`model(*batch[:-1])` and
          `loss_fn(output, batch[-1])` given a `loss_fn`, else `model(*batch)`) or a dict
          (`model(**batch)`, and `loss_fn(output, batch)` given one). Every tensor's rows (dim
          0) are split over the data-parallel ranks and the micro-batches. With no `loss_fn` the
          model computes its own loss: a scalar output, `.loss` (transformers, given `labels`) or
          a "loss" entry; under tp a vocabulary-split head then all-gathers its logits for it.
        - `job.step(inputs, targets, optimizer)`: this rank's rows (`local`), `loss_fn(outputs,
          targets)` (the default: cross-entropy over (b, s, V) logits).

        Forward and backward over the micro-batches, gradients averaged (or reduce-scattered),
        clipped to `grad_clip` (0: not), the optimizer's step. Returns the loss, averaged over
        all ranks. A non-finite gradient norm raises (nothing is updated), except under fp16,
        where it is an overflow: the step is skipped and the loss scale backs off
        (`loss_scaler`), unless the loss itself is not finite. The module's mode is the
        caller's, as in PyTorch (`job.model.train()` / `.eval()`)."""
        optimizers = (torch.optim.Optimizer, WholeMatrices)
        if len(args) == 2 and isinstance(args[1], optimizers):
            optimizer, microbatches = args[1], self._batch(args[0])
        elif len(args) in (3, 4) and isinstance(args[2], optimizers):
            inputs, targets, optimizer, *clip = args
            grad_clip = clip[0] if clip else grad_clip
            microbatches = self._split(inputs, targets)
        else:
            raise TypeError("step(batch, optimizer) or step(inputs, targets, optimizer)")
        self.parallelized.module.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)
        loss_sum, norm = self.parallelized.step(microbatches, optimizer, grad_clip)
        loss = self.global_mean(loss_sum)
        overflow = self.loss_scaler is not None and math.isfinite(loss)
        if not math.isfinite(norm) and not overflow:
            why = "before any update: the model's forward, its loss or the batch made it" \
                if self._steps == 0 else \
                "(a learning rate too high, or the model, loss or batch)"
            raise FloatingPointError(f"step {self._steps}: the gradient norm is {norm}; nothing "
                                     f"was updated; {why}")
        self._steps += 1
        return loss

    def _batch(self, batch) -> list[tuple[Call, object]]:
        """This rank's micro-batches of a global batch as the model takes it: (the call, the
        target: None where the model computes its own loss)."""
        if self.parallelized.axes["pp"].size > 1 or self.parallelized.context.size > 1:
            raise ValueError("a batch as the model takes it runs without pipeline or context "
                             "parallelism (pp = cp = 1); pass (inputs, targets) tensors")
        return as_microbatches(batch, self.rows_rank, self.rows, self.microbatches,
                               self.own_loss)

    @property
    def loss_scaler(self) -> LossScaler | None:
        """fp16's loss scale (`.scale`) and skipped steps (`.skipped`); None otherwise. A
        skipped step should leave the learning rate where it was (plait's trainer does)."""
        return self.parallelized.scaler

    def _split(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[tuple]:
        M = self.microbatches
        if len(inputs) % M:
            raise ValueError(f"{len(inputs)} rows per rank do not split into {M} micro-batches")
        rows = len(inputs) // M
        return list(zip(inputs.split(rows), targets.split(rows), strict=True))

    def verify(self, inputs: torch.Tensor, targets: torch.Tensor,
               tolerance: float = 1e-4) -> Verdict:
        """One step of this layout on the global batch (`inputs`, `targets`, the same on every
        rank) against one of the model as it was handed to `prepare` (`verify=True` kept a
        copy), from the same weights: the loss and each parameter group's largest gradient
        difference (`plait/train/verify.py`); `Verdict.failures()` names what is beyond
        `tolerance`. Nothing is updated."""
        if self.reference is None:
            raise RuntimeError("verify needs plait.prepare(..., verify=True), which keeps a copy "
                               "of the model to compare with")
        local = self._split(*self.local(inputs, targets))
        return verify_step(self.parallelized, self.reference, local, inputs, targets,
                           self.loss_fn, self.global_mean, tolerance, self.world)

    def activations(self) -> SavedActivations:
        """A count of what autograd saves for backward on this rank, for the steps run inside
        it: `with job.activations() as saved: job.step(...)`, then `saved.peak`, the most bytes
        held at once (what `plait.estimate` predicts as `activation_bytes`; parameters, and
        views of them, are not counted). Its hooks cost time, so nothing counts unless asked."""
        return SavedActivations(self.parallelized.module)

    def global_mean(self, value: float) -> float:
        """Mean over the ranks that split the batch of a per-rank mean (summed over pp first:
        the loss exists on the last stage)."""
        device = next(self.parallelized.module.parameters()).device
        t = torch.tensor([value], dtype=torch.float64, device=device)
        all_reduce(t, self.parallelized.axes["pp"].group)
        all_reduce(t, self.parallelized.axes["batch"].group)
        return t.item() / self.parallelized.axes["batch"].size

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter this rank's stage holds, whole, by the model's own names."""
        engine = self.parallelized.engine
        if hasattr(engine, "full_state_dict"):
            return engine.full_state_dict()
        return {n: p.detach().clone() for n, p in self.parallelized.module.named_parameters()}

    def comm(self) -> dict:
        """What this rank's collectives moved since the last call (plait's ledger: bus bytes,
        by operation, calls, seconds waited); resets it."""
        out = LEDGER.snapshot()
        LEDGER.reset()
        return out

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Model-state bytes this rank holds: params, grads, optimizer (and compression)."""
        return self.parallelized.state_bytes(optimizer)

    def param_groups(self) -> dict[str | None, list[torch.Tensor]]:
        """What the optimizer steps on this rank (as `parameters()`), by the group
        `prepare(groups=...)` gave each parameter: build torch's parameter groups from it, e.g.
        `[{"params": ps, "weight_decay": 0.0 if g == "no_decay" else 0.1} for g, ps in
        job.param_groups().items()]`. Under ZeRO a slice never mixes two groups."""
        return self.parallelized.engine.param_groups()

    def optimizer(self, whole: Factory, rest: Factory) -> WholeMatrices:
        """An optimizer of `whole(tensors)` over the parameters `prepare(whole=...)` named, each
        whole on the rank that owns it (`torch.optim.Muon`, `torch.optim.Adafactor`, anything
        that needs a matrix whole), and `rest(tensors)` over the others (this rank's slices
        under ZeRO); one object to `step` with (`plait/optim/whole_matrices.py`)."""
        par = self.parallelized
        if not par.engine.matrices:
            raise ValueError("whole: name the parameters the optimizer needs whole in "
                             "plait.prepare(..., whole=...)")
        decay, no_decay = par.optimizer_groups()
        exchange = MatrixExchange(par.engine, par.record, par.axes["tp"])
        return WholeMatrices(exchange, par.engine.matrix_tensors(), decay + no_decay, whole, rest)

    def save(self, root: str | Path, optimizer: torch.optim.Optimizer, step: int) -> Path:
        """A sharded checkpoint `root/step-NNNNNNNN` of the model and the optimizer's state
        (AdamW's, SGD's; `Prepared.optimizer`'s: each matrix's whole, from its owner), each rank
        writing what it holds; complete once `COMPLETE` is there."""
        path = ckpt.step_path(root, step)
        if self.world.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(path, ignore_errors=True)
        barrier(self.world.group)
        state = rank_state.training_state(self.parallelized, optimizer, step)
        dcp.save(state, checkpoint_id=str(path), planner=SaveBoxes())
        if self.world.rank == 0:
            info = {"step": step, "world_size": self.world.size,
                    "contents": ["model", "optim", "train"],
                    "config": {"parallel": dataclasses.asdict(self.config)}}
            ckpt.finish(path, info)
        barrier(self.world.group)
        return path

    def load(self, path: str | Path, optimizer: torch.optim.Optimizer) -> int:
        """Read a checkpoint made on any layout: `path` is one (what `save` returned) or the
        folder `save` wrote into, whose newest complete checkpoint is read; returns its step."""
        found = ckpt.find(str(path), "")
        if found is None:
            raise FileNotFoundError(f"{path}: no complete checkpoint there (a step folder with "
                                    f"{ckpt.MARKER}, or a folder of them, as `save` writes)")
        return rank_state.load(found, self.parallelized, optimizer, self.world.group)


def _check_arguments(model: nn.Module, precision: str, param_dtype: str,
                     loss_scaler: LossScaler | None, whole: bool,
                     parallel: ParallelConfig) -> None:
    if next(model.parameters(), None) is None:
        raise ValueError(f"model: {type(model).__name__} has no parameters; nothing to train")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model: every parameter of {type(model).__name__} has "
                         "requires_grad=False; nothing to train (unfreeze what should learn)")
    if precision not in ("fp32", *HALF):
        raise ValueError(f"precision: 'fp32', 'bf16' or 'fp16', got {precision!r}")
    if param_dtype not in ("auto", "fp32", precision):
        raise ValueError(f"param_dtype: 'auto', 'fp32' or precision's {precision!r}, got "
                         f"{param_dtype!r}")
    if whole and param_dtype in HALF and parallel.zero == 0:
        raise ValueError(f"param_dtype: {param_dtype!r} parameters under parallel.zero = 0 keep "
                         "flat fp32 masters, and `whole` optimizers step whole matrices there: "
                         "use parallel.zero >= 1, or 'auto'")
    if loss_scaler is not None and precision != "fp16":
        raise ValueError(f"loss_scaler: loss scaling is for precision='fp16', not {precision!r}")
    check_plan(model, parallel.tp)  # on this rank's modules, before anything is communicated


def prepare(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    parallel: ParallelConfig | None = None,
    *,
    wrap: WrapPolicy | None = None,
    checkpoint: WrapPolicy | None = None,
    precision: str = "fp32",
    param_dtype: str = "auto",
    loss_scaler: LossScaler | None = None,
    device: torch.device | str | None = None,
    verify: bool = False,
    whole: bool | Callable[[str, nn.Parameter], bool] = False,
    groups: Callable[[str, nn.Parameter], str] | None = None,
    compile: bool | None = None,  # noqa: A002 -- train.compile's name
    compile_backend: str = "inductor",
) -> Prepared:
    """Apply `parallel` (default: DDP over every rank) to `model` on the world `init` joined.
    `loss_fn(outputs, targets)` is the mean loss of a micro-batch (None: cross-entropy over
    (b, s, V) logits); `wrap` chooses ZeRO-3's units and `checkpoint` the modules recomputed in
    the backward (classes, or a parameter count); `precision` "fp32", "bf16" or "fp16" (with
    `loss_scaler`, default dynamic from 2^16: `plait.LossScaler`); `param_dtype` the parameters'
    dtype under it (`train.param_dtype`: "auto", "fp32", or the half one, fp32 masters). The
    model's own weights are used (every rank starts from rank 0's); move it to `device` first or
    pass it.
    `verify`: keep a copy of the model for `Prepared.verify`. `whole`: the parameters an
    optimizer needs whole (a test of (name, parameter); True: Muon's, the 2-D weights of a plan's
    blocks or of `nn.Linear`s), for `Prepared.optimizer`. `groups(name, parameter)`: each
    parameter's optimizer group, for `Prepared.param_groups` (weight decay by name, under ZeRO
    too). `compile`: each unit's forward through `torch.compile` (the plan's blocks, or what
    `wrap` chooses; None: on for CUDA, off on the CPU), with `compile_backend`."""
    if not dist.is_initialized():
        raise RuntimeError("call plait.init() first: it joins the world of processes")
    parallel = parallel or ParallelConfig()
    _check_arguments(model, precision, param_dtype, loss_scaler, bool(whole), parallel)
    dims = validate_parallel(parallel, dist.get_world_size(), precision)
    where = torch.device(device) if device is not None else next(model.parameters()).device
    model.to(where)
    world = world_axis().group
    with torch.no_grad():  # every rank starts from rank 0's weights and buffers
        for t in [*model.parameters(), *model.buffers()]:
            broadcast(t.data, src=0, group=world)
    reference = copy.deepcopy(model) if verify else None
    M = parallel.microbatches or dims.pp
    mode = "full" if checkpoint else "none"
    options = Options(microbatches=M, precision=precision, param_dtype=param_dtype,
                      activation_checkpointing=mode, loss_fn=loss_fn, wrap=wrap or WrapPolicy(),
                      checkpoint=checkpoint or WrapPolicy(), scaler=loss_scaler, whole=whole,
                      groups=groups)
    parallelized = parallelize(model, build_mesh(dims, where.type), parallel, options)
    if compile_enabled("auto" if compile is None else compile, where):
        compiled = apply_compile(parallelized.module, compile_backend, wrap,
                                 required=compile is not None, loss_fn=parallelized.loss_fn)
        if not compiled and dist.get_rank() == 0:
            print("plait: note: compile: no unit to compile (no plan, and `wrap` chooses no "
                  "module); the model runs eager", file=sys.stderr)
    # The reference's loss: the user's, or cross-entropy over whole logits (the layout's may be
    # the vocabulary-parallel one).
    return Prepared(parallelized, M, parallel, loss_fn or cross_entropy, reference,
                    own_loss=loss_fn is None)
