"""`parallelize`: one straight line, the same for every configuration (docs/design.md, "One
straight line"):

    model -> pipeline chunks (pp = 1: one chunk)
          -> per chunk: tensor (+ sequence), context and expert parallelism, activation
             checkpointing
          -> the data-parallel engine `parallel.zero` names, over all of this stage's chunks
             (DDP | ZeRO-1/2 | ZeRO-3, over the dp x cp x ep ranks or, hybrid, groups of
             dp_shard ranks)

Each transform writes its axis into one placement record (`placement.py`), which is then checked
complete and against the tensors actually held. The trainer drives the result through one
interface (`Parallelized`): the schedule's executor runs the micro-batches (one stage: gradient
accumulation), the engine finishes the gradients, one global norm clips them, the optimizer steps.
Under context parallelism the trainer cuts each sequence by `Parallelized.context`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.comm import all_reduce, broadcast
from plait.comm.trace import TRACER
from plait.config.choices import held_precision
from plait.config.schema import ParallelConfig
from plait.host_memory import give_back_freed
from plait.mesh import AXES, Axis, batch_axis
from plait.model.documents import Documents
from plait.model.materialize import Filler, Source, is_meta, materialize
from plait.model.plan import has_plan, plan_of
from plait.optim.loss_scaling import HALF, LossScaler
from plait.optim.muon_routes import muon_matrices
from plait.parallel.activation_checkpoint import apply_activation_checkpointing
from plait.parallel.context_parallel import ContextLayout, apply_cp
from plait.parallel.dropout import seed_ranks
from plait.parallel.embedding_grad import sum_embedding_grads_in_fp32
from plait.parallel.engines import build_data_parallel
from plait.parallel.engines.replicas import SyncedReplicas
from plait.parallel.engines.units import first_unit_spans, unit_names
from plait.parallel.expert_parallel import apply_ep, has_experts, moe_layers
from plait.parallel.grads import by_device_and_dtype, scale_grads_
from plait.parallel.pipeline import PipelineExecutor, StageModules, apply_pp, forward_only
from plait.parallel.pipeline.executor import Activation
from plait.parallel.placement import OptimizerClasses, PlacementRecord, ZeroUnit
from plait.parallel.tensor_parallel import apply_tp
from plait.parallel.vocab_parallel import HeadCrossEntropy
from plait.parallel.wrap import WrapPolicy, policy_of


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens of (b, s, V) logits and (b, s) targets."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclass(frozen=True)
class Options:
    """What `parallelize` reads besides the model, the mesh and the layout: how the step runs
    (micro-batches, precision, recomputation), what a model with no plan says about itself (any
    `nn.Module`, through the Python API: its loss, ZeRO-3's units, what to recompute), where a
    model on `meta` gets its weights, and what the optimizer needs of the engine."""

    microbatches: int = 1
    precision: str = "fp32"  # "bf16", "fp16": computes under autocast
    # Held parameters: "auto" (half under ZeRO only), "fp32" or a half dtype under every engine
    # (`choices.held_precision`), with fp32 masters of what each rank steps.
    param_dtype: str = "auto"
    activation_checkpointing: str = "none"
    loss_fn: Callable[..., torch.Tensor] | None = None  # (outputs, targets) -> mean loss;
    # None: cross-entropy over (b, s, V) logits
    wrap: WrapPolicy = WrapPolicy()  # ZeRO-3's units of a model with no plan (else
    # `parallel.wrap`, else the model's `unit_classes`)
    checkpoint: WrapPolicy = WrapPolicy()  # what activation checkpointing = "full" recomputes
    source: Source | None = None  # the weights of a model built on `meta`
    scaler: LossScaler | None = None  # fp16's; default: dynamic from 2^16
    # The parameters an optimizer needs whole (True: Muon's, `muon_matrices`; or a test of
    # (name, parameter)), kept in flat buffers of their own.
    whole: bool | Callable[[str, nn.Parameter], bool] = False
    groups: Callable[[str, nn.Parameter], str] | None = None  # each parameter's optimizer group


@dataclass
class Parallelized:
    """A model with its parallelisms applied, and what the training step needs to go with them."""

    module: StageModules  # this rank's chunks; parameters named as in the single-device model
    engine: SyncedReplicas  # the data-parallel engine over them
    record: PlacementRecord
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> loss
    pipeline: PipelineExecutor  # runs a training step's schedule over the micro-batches
    pipeline_eval: PipelineExecutor  # and a forward-only pass
    axes: dict[str, Axis]  # this rank's mesh axes
    context: ContextLayout  # which tokens of each sequence this rank holds (cp)
    scaler: LossScaler | None = None  # fp16's loss scale (None: no scaling)
    moe: list = dataclasses.field(default_factory=list)  # the mixtures of experts: their
    # auxiliary losses' gradients carry the loss scale too

    def optimizer_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(decay, no_decay): the tensors the optimizer owns (under ZeRO: this rank's slices)."""
        return self.engine.optimizer_groups()

    def finish_gradients(self) -> None:
        self.engine.finish_gradients()

    def step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]],
             optimizer: torch.optim.Optimizer, grad_clip: float = 0.0) -> tuple[float, float]:
        """One optimizer step, the one every caller drives (trainer, Python API, benches):
        buffers synced, the schedule over this rank's micro-batches (inputs, targets), gradients
        finished, the global norm, clipping to `grad_clip` (0: none), the optimizer's step.
        Returns (the sum of this rank's micro-batch losses, each divided by their number; the
        global norm of the unscaled gradient); when the norm is not finite nothing is updated,
        the loss scale (fp16) backs off, and the caller decides what else that means."""
        before = self.scaler.scale if self.scaler is not None else 1.0
        loss_sum, scale = self.run_schedule(microbatches)
        # The global norm, every step: for clipping, and because a NaN or infinite loss or
        # gradient anywhere shows in it, the same on every rank (it is reduced over the axes
        # whose ranks hold different gradients; replicas hold equal ones). Gradients are still
        # scaled: dividing the norm by the scale (a power of two: exactly) unscales it.
        with TRACER.span("gradient norm"):
            norm = self.grad_norm_sq().sqrt().item() / scale
        if self.scaler is not None:
            self.scaler.update(overflow=not math.isfinite(norm))
            if self.engine.compression is not None:  # error feedback follows the scale
                self.engine.compression.rescale(self.scaler.scale / before)
        if not math.isfinite(norm):
            return loss_sum, norm  # no update: every rank decides alike
        # Unscaling and clipping in one pass: g * (coef / scale) is g / scale * coef, rounded once.
        coef = min(1.0, grad_clip / (norm + 1e-6)) if grad_clip > 0 else 1.0
        if coef / scale != 1.0:  # an optimizer of whole matrices names the pieces it reads
            scale_grads_(optimizer.grads_to_scale() if hasattr(optimizer, "grads_to_scale") else
                         [p for g in optimizer.param_groups for p in g["params"]], coef / scale)
        with TRACER.span("optimizer"):
            optimizer.step()
            self.finish_step()
        return loss_sum, norm

    def run_schedule(self, microbatches: list[tuple]) -> tuple[float, float]:
        """The forward and backward part of `step`: buffers synced, the schedule over this rank's
        micro-batches, gradients finished (reduced, or reduce-scattered). Returns (the sum of
        the micro-batch losses, each divided by their number; the factor the loss was scaled
        by). `plait.predict.trace` runs this alone, on fake tensors."""
        self.engine.begin_step()
        self.sync_buffers()
        # fp16: each rank's loss is multiplied by the scale divided by the number of ranks whose
        # gradients the engine averages, so that its activations' gradients are as large as one
        # process's over the whole batch: the scale overflows where one process's would.
        scale = self.scaler.scale / self.axes["batch"].size if self.scaler is not None else 1.0
        self.pipeline.loss_scale = scale
        for layer in self.moe:
            layer.loss_scale = scale
        self._whole_logits(any(mb[1] is None for mb in microbatches))
        loss_sum = self.pipeline.run(microbatches)
        with TRACER.span("finish gradients"):
            self.finish_gradients()
        return loss_sum, scale

    def split(self, inputs: torch.Tensor, targets: torch.Tensor, microbatches: int,
              documents: torch.Tensor | None = None) -> list[tuple[torch.Tensor, ...]]:
        """This rank's rows of token windows (inputs, targets: (rows, seq)) as the schedule takes
        them: its part of each sequence (cp), cut into `microbatches` runs of rows. With
        `documents` (rows, seq: each input token's document in its window, `data.document_mask`)
        each micro-batch's `Documents` comes third: the whole windows' (every cp rank masks
        keys from the others' shards) and where this rank's tokens lie in them."""
        seq = inputs.shape[1]
        inputs, targets = self.context.shard(inputs), self.context.shard(targets)
        rows = len(inputs) // microbatches
        out = list(zip(inputs.split(rows), targets.split(rows), strict=True))
        if documents is None:
            return out
        held = Documents(documents, self.context.index(seq, documents.device))
        return [(*pair, docs) for pair, docs in zip(out, held.rows(microbatches), strict=True)]

    def _whole_logits(self, on: bool) -> None:
        """Whether a vocabulary-split head all-gathers its logits: for a model that computes its
        own loss (micro-batches without targets) rather than plait's vocabulary-parallel one."""
        for chunk in self.module.values():
            name = plan_of(chunk).vocab_head if has_plan(chunk) else None
            head = getattr(chunk, name, None) if name else None
            if hasattr(head, "whole_logits"):
                head.whole_logits = on

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Before a step: persistent buffers (BatchNorm's running statistics) from the first rank
        of the batch group, as torch DDP does (`broadcast_buffers`); a model with none (plait's
        Llama: its rotary tables are not state) communicates nothing."""
        group = self.axes["batch"].group
        for module in self.module.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    broadcast(buffer, src=0, group=group)

    def finish_step(self) -> None:
        """After the optimizer step: ZeRO gathers the updated slices back into every replica."""
        self.engine.finish_step()

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return self.engine.state_bytes(optimizer)

    def grad_norm_sq(self) -> torch.Tensor:
        """Squared norm of the whole model's averaged gradient. Each rank sums the pieces it
        counts once (placement record: shards everywhere, replicas on the first coordinate of
        each axis summed over), then one all-reduce of one float64 per axis whose ranks hold
        different pieces: pp, tp and ep (experts), and the engine's sharding group under ZeRO
        (dp x cp; under expert parallelism the experts' sharding group over dp, then ep:
        together they shard the dense parameters, the first the experts). Plain data parallelism
        communicates nothing for it: every replica has the whole gradient."""
        axes = [a for a in (self.axes["pp"], self.axes["tp"], self.axes["ep"]) if a.size > 1]
        over = {a.name for a in axes}
        storage = self.engine.storage_axis
        if storage is not None and storage.size > 1:
            over -= {"ep"}  # the dense slices differ over dp x ep; experts are ep shards
            axes.append(self.engine.expert_axis if self.axes["ep"].size > 1 else storage)
        total = torch.zeros(1, dtype=torch.float64, device=_device(self.module))
        counted = [piece.detach() for name, piece in self.engine.grad_pieces()
                   if self.record.counts_once(name, over)]
        for pieces in by_device_and_dtype(counted):
            # Each piece's norm accumulated in fp32 (as torch's clip_grad_norm_), their squares
            # summed in fp64; reading each gradient once (a fp64 copy of every gradient, squared,
            # was ~30 GB of memory traffic a step at 1.5B parameters).
            norms = torch._foreach_norm(pieces, 2, dtype=torch.float32)
            total += torch.stack(norms).double().pow(2).sum()
        for axis in axes:
            all_reduce(total, axis.group)
        return total[0]


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig,
                options: Options = Options()) -> Parallelized:
    """Apply every configured parallelism to `model` in the documented order. A half
    precision ("bf16", "fp16") computes under autocast; the parameters are held in it, with fp32
    masters of what each rank steps, where `options.param_dtype` says, else in fp32. fp16 scales
    the loss by `options.scaler` (`loss_scaling.py`). Do not use `model` afterwards: its pieces
    now live in the returned chunks. A model with no plan gets the data-parallel engines
    (`options` says what it would otherwise read from a plan); a degree that needs a plan
    raises, naming it. A model built on `meta` is materialized from `options.source` after it is
    cut: each rank makes only what it holds (under ZeRO-3, its slices;
    `plait.model.materialize`). The parameters `options.whole` names go to flat buffers of their
    own, for `optim.muon.MatrixExchange`; flat buffers never mix two of `options.groups`
    (`Parallelized.engine.param_groups()`)."""
    wrap = unit_policy(model, cfg, options.wrap)
    axes = {a: Axis.of(mesh, a) for a in AXES}
    axes["batch"] = batch_axis(axes)
    chunks, schedule, record = place(model, axes, cfg, options.microbatches,
                                     options.activation_checkpointing, options.checkpoint,
                                     wrap, options.whole, options.groups)
    # Gradients that are partial sums must be summed: over dp x cp x ep by the data-parallel
    # engine, over tp (the norm gains under sequence parallelism, routers) by tensor
    # parallelism's hooks.
    unsynced = record.grad_sync_axes() - {"dp", "cp", "ep", "tp"}
    if unsynced:
        raise RuntimeError(f"no transform sums the gradients over {sorted(unsynced)}")
    fill = _fill(chunks, record, options.source, cfg.zero)
    sum_embedding_grads_in_fp32(chunks)  # where they are held in half on the CPU
    half = HALF.get(options.precision)
    held = HALF.get(held_precision(options.precision, options.param_dtype, cfg.zero))
    # The matrices the engine keeps apart: those an optimizer of this run steps whole.
    matrices = record.optimizer.matrices if options.whole else frozenset()
    engine = build_data_parallel(chunks, mesh, cfg, held, axes, record, wrap, fill,
                                 matrices)
    record.check({n: tuple(p.shape) for n, p in chunks.named_parameters()})
    seed_ranks(axes, cfg.sequence_parallel)  # dropout's masks (`dropout.py`)
    loss_fn = _loss(model, options.loss_fn, axes["tp"])
    train, evaluate = _executors(model, chunks, schedule, axes, cfg, half, held, loss_fn,
                                 engine)
    context = ContextLayout(cfg.cp_method, axes["cp"].rank, axes["cp"].size)
    scaler = None
    if options.precision == "fp16":
        scaler = options.scaler if options.scaler is not None else LossScaler()
    moe = [layer for chunk in chunks.values() for layer in moe_layers(chunk).values()]
    return Parallelized(chunks, engine, record, loss_fn, train, evaluate, axes, context,
                        scaler, moe)


def _fill(chunks: nn.ModuleDict, record: PlacementRecord, source: Source | None,
          zero: int) -> Filler | None:
    """A model on `meta` made real, rank by rank: under ZeRO-3 a filler the engine asks for
    each unit's slice as it builds it; otherwise the whole of what this rank holds, now."""
    if not is_meta(chunks):
        return None
    if source is None:
        raise ValueError("the model is on the meta device: pass the source of its weights")
    if zero == 3:
        return Filler(source, record)
    materialize(chunks, record, source)
    give_back_freed()  # the draws' blocks, freed between the tensors kept
    return None


def _loss(model: nn.Module, loss_fn: Callable | None, tp: Axis) -> Callable:
    """The loss of the last stage: the user's, or cross-entropy; under tp, where the plan
    splits the head by vocabulary, plait's vocabulary-parallel cross-entropy."""
    plan = plan_of(model) if has_plan(model) else None
    if plan is None or plan.vocab_head is None or tp.size == 1 and loss_fn is not None:
        return loss_fn or cross_entropy
    if loss_fn is not None:
        raise ValueError("parallel.tp splits the output head by vocabulary: the loss is "
                         "plait's vocabulary-parallel cross-entropy; pass no loss_fn")
    if tp.size == 1:
        return HeadCrossEntropy()
    return HeadCrossEntropy(tp.group, getattr(model.args, plan.vocab_size))


def _executors(model: nn.Module, chunks: nn.ModuleDict, schedule, axes: dict[str, Axis],
               cfg: ParallelConfig, half: torch.dtype | None, held: torch.dtype | None,
               loss_fn: Callable, engine) -> tuple[PipelineExecutor, PipelineExecutor]:
    """The schedule's executor for training, and a forward-only one for evaluation, both over
    this rank's chunks under autocast where the precision is half. What passes between stages
    (only pp > 1, which needs a plan, sends anything) is in the parameters' dtype (`held`:
    half, or None for fp32)."""
    plan = plan_of(model) if has_plan(model) else None
    tp = axes["tp"]
    width = getattr(model.args, plan.hidden_size) if plan and axes["pp"].size > 1 else 0
    activation = Activation(width, tp.size if cfg.sequence_parallel else 1,
                            held or torch.float32)
    device = _device(chunks)
    compute = contextlib.nullcontext
    if half is not None:
        compute = functools.partial(torch.autocast, device.type, dtype=half)
    by_index = {int(c): m for c, m in chunks.items()}
    pp_group = axes["pp"].group
    train = PipelineExecutor(schedule, by_index, pp_group, loss_fn, activation, device,
                             engine.no_sync, compute)
    evaluate = PipelineExecutor(
        forward_only(schedule.stages, schedule.microbatches, schedule.chunks_per_stage),
        by_index, pp_group, loss_fn, activation, device, compute=compute)
    return train, evaluate


def unit_policy(model: nn.Module, cfg: ParallelConfig, wrap: WrapPolicy | None) -> WrapPolicy:
    """ZeRO-3's units where the plan's blocks are not (`units.unit_modules`): the caller's policy
    (`Options.wrap`), else `parallel.wrap`'s, else, for a model with no plan, the model's own
    (`wrap.policy_of`); empty for a planned model whose run names none (its blocks)."""
    if wrap:
        return wrap
    if has_plan(model) and not cfg.wrap:
        return WrapPolicy()
    return policy_of(model, cfg.wrap)


def place(model: nn.Module, axes: dict[str, Axis], cfg: ParallelConfig, microbatches: int,
          activation_checkpointing: str = "none", checkpoint: WrapPolicy | None = None,
          wrap: WrapPolicy | None = None,
          whole: bool | Callable[[str, nn.Parameter], bool] = False,
          groups: Callable[[str, nn.Parameter], str] | None = None):
    """The model-parallel part of the straight line, which needs no communication to apply:
    pipeline chunks, then per chunk tensor (+ sequence), context and expert parallelism and
    activation checkpointing; the data-like axes replicate. Returns (chunks, schedule, placement
    record). With dry axes (`Axis.dry`) and a `meta` model it runs in one process: `plait train
    --dry-run`. `axes` holds the mesh axes and "batch", the dp x cp x ep ranks that split the
    batch. What the optimizer needs of the engine is recorded for the formulas: the matrices a
    test `whole` names (else Muon's, which they read when `train.optimizer` is Muon) and the
    parameters' `groups` (`Options`)."""
    record = PlacementRecord({a: axes[a].rank for a in AXES}, {a: axes[a].size for a in AXES})
    wrap = unit_policy(model, cfg, wrap)  # before the model is cut
    if not checkpoint and not has_plan(model):  # "full" recomputes the model's own units (a
        checkpoint = policy_of(model)  # transformers family's decoder layer), if it has any
    if axes["ep"].size > 1 and not has_experts(model):
        raise ValueError(f"parallel.ep={axes['ep'].size}: {type(model).__name__} has no "
                         "mixture-of-experts layer its plan names (plan.moe); use ep = 1")
    # A chunk of dense blocks only (a pipeline stage between MoE layers) keeps its ep ranks as
    # replicas: its parameters are dense, synchronised over dp x cp x ep like any other.
    chunks, schedule = apply_pp(model, axes["pp"], cfg, microbatches, record)
    for chunk in chunks.values():
        apply_tp(chunk, axes["tp"], cfg.sequence_parallel, record)
        apply_cp(chunk, axes["cp"], cfg.cp_method)
        # Every tp rank attaches the auxiliary losses; the micro-batch's share of the loss is 1/M.
        apply_ep(chunk, axes["ep"], axes["batch"], record, 1 / (microbatches * axes["tp"].size))
        apply_activation_checkpointing(chunk, activation_checkpointing, checkpoint)
    # ZeRO-3's units by parameter name, as the engine will cut them (the plan's blocks, or the
    # wrap policy's modules), for the formulas.
    for c, chunk in chunks.items():
        c = int(c)
        record.chunk_of.update({n: c for n, _ in chunk.named_parameters()})
        record.units += [ZeroUnit(names, c, k == 0 and first_unit_spans(chunk, wrap))
                         for k, names in enumerate(unit_names(chunk, wrap)) if names]
        record.frozen.update({n: p.element_size() for n, p in chunk.named_parameters()
                              if not p.requires_grad})
    matrices = muon_matrices(model, chunks)
    if callable(whole):
        matrices = frozenset(n for n, p in chunks.named_parameters() if whole(n, p))
    record.optimizer = OptimizerClasses(
        matrices, {n: groups(n, p) for n, p in chunks.named_parameters()} if groups else {})
    record.replicate_all("cp", partial_grad=True)  # other tokens of the same rows
    record.replicate_all("dp", partial_grad=True)  # other rows of the batch
    return chunks, schedule, record


__all__ = ["Options", "Parallelized", "cross_entropy", "parallelize", "place"]
