"""What one rank of a layout keeps for backward, computes and communicates in a training step,
measured on the model itself before launch, for any model: plait's Llama, a Hugging Face family
(planned or not), a module from Python.

The rank's step runs for real in this one process -- the same `parallelize`, the same schedule,
the data-parallel engine's hooks and collectives, autocast, activation checkpointing -- on fake
tensors (torch's `FakeTensorMode`: shapes, dtypes and storages with no memory behind them), in a
world of torch's "fake" process-group backend (`fake_world`: every collective returns at once,
leaving its output's shape as the real one would). Counted while it runs:

    activation_bytes   the peak of what autograd keeps for backward, by storage: the counter of
                       the run's own `activation_bytes` metric (`predict/activation_memory.py`)
    flops              torch's `FlopCounterMode` over the step's operations on this rank
                       (recomputation included: what the rank executes)
    collectives        the ledger of `plait.comm` (calls and bus bytes per operation), the
                       gradient norm's all-reduces and ZeRO's gathers after the update included

Nothing here knows a model's fields: a rank's trace is its own step. Routing depends on values
(a mixture of experts' token counts), which fake tokens lack: `plait.model.moe` routes them
evenly, which is what a plan prices, and so does `routing.fake_experts` for transformers'
experts modules. A step that reads values anywhere else raises `Untraceable`, in one line.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode, shape_wrapper

from plait.comm import LEDGER, Op
from plait.comm.watchdog import RECORDER
from plait.config.schema import microbatches
from plait.mesh import build_mesh, rows_share
from plait.optim.loss_scaling import LossScaler
from plait.parallel import Options, Parallelized, cross_entropy, parallelize
from plait.parallel.activation_checkpoint import recomputing
from plait.parallel.pipeline import fewest_microbatches
from plait.predict.activation_memory import SavedActivations
from plait.predict.routing import fake_experts, grouped_mm_flops


class Untraceable(RuntimeError):
    """The model's step depends on values a fake tensor does not have (data-dependent shapes)."""


@dataclass
class RankTrace:
    """One rank's training step, as measured on fake tensors."""

    activation_bytes: int  # peak bytes saved for backward (the `activation_bytes` metric's count)
    flops: int  # FLOPs this rank executes in the step (FlopCounterMode; recomputation included)
    recomputed_flops: int = 0  # of those, the ones activation checkpointing's recomputation ran
    calls: dict[Op, int] = field(default_factory=dict)  # collectives issued, per operation
    bytes: dict[Op, Fraction] = field(default_factory=dict)  # bus bytes moved, per operation

    @property
    def comm_bytes(self) -> Fraction:
        return sum(self.bytes.values(), Fraction(0))


@contextlib.contextmanager
def _kept(*objects) -> Iterator[None]:
    """Each object's attributes as they were before: the process-wide ledger and flight recorder
    see a trace's collectives, which are not this process's."""
    saved = [copy.deepcopy(vars(o)) for o in objects]
    try:
        yield
    finally:
        for o, state in zip(objects, saved, strict=True):
            vars(o).clear()
            vars(o).update(state)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as rank `rank` of `world_size`, every collective a no-op that keeps shapes
    (torch's "fake" backend), for the duration. It needs a process with no world of its own:
    a trace runs before `plait.init()`, in the launcher, or in the planner."""
    if dist.is_initialized():
        raise RuntimeError("a trace runs in a world of its own: call it before plait.init() "
                           "(or outside a launched job)")
    # (The generator too: `parallelize` reseeds it for dropout, `parallel/dropout.py`.)
    with _kept(LEDGER, RECORDER), torch.random.fork_rng(devices=[]):
        dist.init_process_group("fake", rank=rank, world_size=world_size)
        try:
            yield
        finally:
            dist.destroy_process_group()


def fake_module(model: nn.Module, device: torch.device | str, mode: FakeTensorMode) -> nn.Module:
    """A copy of `model` whose parameters and buffers are fake tensors on `device` (no storage):
    a model on `meta` gets fresh ones, a real one keeps nothing of its values."""
    def fake(t: torch.Tensor) -> torch.Tensor:
        with mode:
            out = torch.empty(t.shape, dtype=t.dtype, device=device)
        return nn.Parameter(out, t.requires_grad) if isinstance(t, nn.Parameter) else out

    memo = {id(t): fake(t) for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo)


class _Global:
    """A module tracker that knows two places: the whole step, where FLOPs are counted in total,
    and activation checkpointing's recomputations in it (`recomputing()`), counted apart too."""

    @property
    def parents(self) -> frozenset[str]:
        return _RECOMPUTED if recomputing() else _STEP

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


_STEP, _RECOMPUTED = frozenset({"Global"}), frozenset({"Global", "Recomputed"})


def _heads_broadcast(query_shape, key_shape, value_shape):
    """Key and value shapes with their heads broadcast to the query's, as the kernels do under
    grouped-query attention (`enable_gqa`): (batch, heads, seq, head dim) each."""
    heads = query_shape[1]
    return ((*key_shape[:1], heads, *key_shape[2:]), (*value_shape[:1], heads, *value_shape[2:]))


def _gqa_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape,
                                        *_heads_broadcast(query_shape, key_shape, value_shape))


def _gqa_sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args,
                            out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(
        grad_out_shape, query_shape, *_heads_broadcast(query_shape, key_shape, value_shape))


class StepFlops(FlopCounterMode):
    """torch's FLOP counter (its per-operation formulas), totals only: without its module
    tracker, whose backward hooks on each module's inputs keep tensors alive past their time
    (measured: a split backward's last stage then held one more activation, and the activation
    count saw it). It counts attention's CPU kernel as torch counts its GPU kernels, and
    grouped matmuls (transformers' experts) by their products: torch 2.13 has no formula for
    either, which counted nothing. Attention with fewer key/value heads than query heads
    (grouped-query) is counted with the key/value heads broadcast, as the kernel computes and as
    torch 2.13 counts it: torch up to 2.11 asserted that the heads were equal, which stopped a
    run of any grouped-query model on a GPU at its first step."""

    def __init__(self):
        super().__init__(display=False)
        aten = torch.ops.aten
        sdpa = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_flash_attention_for_cpu")
        for name in sdpa:
            if hasattr(aten, name):
                self.flop_registry[getattr(aten, name)] = shape_wrapper(_gqa_sdpa_flop)
            if hasattr(aten, name + "_backward"):
                self.flop_registry[getattr(aten, name + "_backward")] = \
                    shape_wrapper(_gqa_sdpa_backward_flop)
        self.flop_registry[aten._grouped_mm] = shape_wrapper(grouped_mm_flops)
        self.mod_tracker = _Global()

    def __enter__(self):  # torch's own, with its dispatch mode `_Counting` where torch has one
        if not hasattr(flop_counter, "_FlopCounterMode"):
            return super().__enter__()
        self.flop_counts.clear()
        self.mod_tracker.__enter__()
        self.mode = _Counting(self)
        self.mode.__enter__()
        return self


@functools.cache
def _undecomposable(func) -> bool:
    """Whether torch's counter would run `func` as it is: an ATen operation with no
    decomposition (no CompositeImplicitAutograd kernel) that returns tensors (an operation that
    returns none, a size or a stride, computes nothing and keeps torch's path)."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace != "aten":
        return False
    try:
        decomposes = func._can_decompose()
    except (RuntimeError, AttributeError):  # an operator torch no longer has; an older torch
        return False
    returns = func._schema.returns
    return not decomposes and bool(returns) and all(
        isinstance(r.type, torch.TensorType) for r in returns)


class _Counting(getattr(flop_counter, "_FlopCounterMode", object)):
    """torch's counting mode, without its try at decomposing each operation that has no formula
    (its registry is keyed by packet, so it tries every operation, entering the mode again for
    each): an operation with no decomposition runs and is counted at once, as torch would after
    that try returned nothing. 7-14% of a trace's CPU (the matrix rows' traces, measured). A
    torch without that mode (its counter a mode itself) counts as it does (`StepFlops`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _undecomposable(func):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            return self.counter._count_flops(func._overloadpacket, out, args, kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def _traceable() -> Iterator[None]:
    """Run a step on fake tensors as it runs on real ones, or raise `Untraceable`. transformers
    asks whether a batch's positions pack several sequences into a row by reading them, and
    takes a fake tensor for a compiler's trace: it would build a (rows, 1, seq, seq) causal
    mask that the real step does not (GPT-2 passes its positions). A row of plait's batches is
    one sequence: the trace answers so."""
    masking = sys.modules.get("transformers.masking_utils")
    packed = getattr(masking, "find_packed_sequence_indices", None)
    if packed is not None:
        masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise Untraceable(f"the model's step depends on values a fake tensor does not hold "
                          f"({e.func}): no prediction before launch; its metrics measure it") \
            from None
    except RuntimeError as e:  # the step took the values out of torch (.numpy())
        if ".numpy()" not in str(e):
            raise
        raise Untraceable("the model's step reads its tensors' values outside torch (.numpy()): "
                          "no prediction before launch; its metrics measure it") from None
    finally:
        if packed is not None:
            masking.find_packed_sequence_indices = packed


def model_flops(cfg) -> float:
    """MFU's numerator: the FLOPs of one training step of the model whole, in one process, as
    `FlopCounterMode` counts them on fake tensors -- the forward and backward of the global batch
    of `cfg` (a `plait.config.schema.Config`), without recomputation or what a layout repeats on
    several ranks. Raises `Untraceable` where the step reads values.

    Counted once per model, global batch and sequence length in a process (`MODEL_FLOPS`; no
    layout, precision or seed changes them; a Hugging Face folder's per version of its
    config.json), and inherited by the processes it forks: a trainer traced its model at every
    run's start (1-2 s of one core on a small model, while the other ranks waited), and
    tests/harness.py counts each world's model once before forking its ranks."""
    key = repr((cfg.model.key(), cfg.model.version(), cfg.train.global_batch, cfg.data.seq_len))
    if key not in MODEL_FLOPS:
        MODEL_FLOPS[key] = _count_model_flops(cfg)
    return MODEL_FLOPS[key]


MODEL_FLOPS: dict[str, float] = {}


def _count_model_flops(cfg) -> float:
    meta = cfg.model.build(cfg.train.seed, "meta")
    with FakeTensorMode() as mode:
        model = fake_module(meta, "cpu", mode)
        tokens = torch.zeros(cfg.train.global_batch, cfg.data.seq_len, dtype=torch.int64)
        with _traceable(), fake_experts(model), StepFlops() as flops:
            cross_entropy(model(tokens), tokens).backward()
    return float(flops.get_total_flops())


def trace_step(parallelized: Parallelized, microbatches: list[tuple]) -> RankTrace:
    """Run the forward and backward part of the training step (`Parallelized.run_schedule`), then
    the gradient norm's and the engine's after-update collectives, counting. Call it inside a
    `fake_world` and a `FakeTensorMode`, on a fake `parallelized`."""
    counter = SavedActivations(parallelized.module)
    LEDGER.reset()
    with _traceable(), fake_experts(parallelized.module), counter, StepFlops() as flops:
        parallelized.run_schedule(microbatches)
    parallelized.grad_norm_sq()  # one float64 all-reduce per axis whose ranks hold pieces
    parallelized.finish_step()  # ZeRO: the updated slices gathered back
    recomputed = sum(flops.get_flop_counts().get("Recomputed", {}).values())
    return RankTrace(counter.peak, flops.get_total_flops(), recomputed, dict(LEDGER.calls),
                     dict(LEDGER.bytes_by_op))


def representative(dims, rank: int) -> int:
    """The rank whose trace stands for `rank`'s: the one of its pipeline stage and context shard
    with every other coordinate 0. Ranks differing only in dp, ep or tp run the same shapes (the
    checks make every split even), so a 1,024-rank layout traces a few ranks; cp ranks differ
    (ring attention's blocks are the rank's own)."""
    c = dims.coords(rank)
    return dims.rank(pp=c["pp"], cp=c["cp"])


def trace_class(cfg, dims, rank: int) -> RankTrace:
    """`trace_rank` of `representative(dims, rank)`, cached per configuration as far as its
    activations and FLOPs depend on it, which is what its callers read (the planner, the dry run;
    its collectives are not kept): ZeRO's stages 1, 2 and 3, whether stage 3 reshards after forward,
    and what it prefetches (`max_live_params`), keep the same tensors for backward and run the same
    FLOPs (measured alike in fp32 and bf16, with and without recomputation), so the planner traces
    one of them, not four; and without a pipeline one micro-batch is traced, not each
    (`first_stands_for_all`), with one as many as the stage holds at its fullest. The run's device
    (`train.device`) is not part of it either: a trace runs on fake CPU tensors whatever it names
    (the planner prices a GPU cluster's layouts with "cuda", and its warnings asked again with the
    configuration as given: a second trace of every layout, a fifth of `plait plan`'s time for a
    Hugging Face model). Nor is ZeRO's offload, which moves model state to host memory, not what the
    step keeps for backward or computes (the planner's search for the leanest layout tries three
    offloads of each mesh)."""
    par = dataclasses.replace(cfg.parallel, offload="none")
    if par.zero:
        par = dataclasses.replace(par, zero=1, reshard_after_forward=True, max_live_params=0)
    same = dataclasses.replace(cfg, parallel=par,
                               train=dataclasses.replace(cfg.train, device="cpu"))
    key = (repr(same), dims, representative(dims, rank))
    if key not in _TRACES:
        if len(_TRACES) >= 256:  # the planner prices many layouts; keep the recent ones
            _TRACES.clear()
        _TRACES[key] = trace_rank(cfg, dims, key[-1], first_only=True)
    return _TRACES[key]


_TRACES: dict[tuple, RankTrace] = {}


def first_stands_for_all(cfg, dims) -> bool:
    """Whether a step's first micro-batch stands for all of them: where they run one after
    another, each freeing what it saved before the next (no pipeline), and nothing but them
    computes matmuls (no compression's low-rank products), the step's activations are the
    first's (its inputs views of the whole batch's windows, as each one's are) and its FLOPs
    that many times the first's (`tests/dist` compares each row's dry run with its
    measurement; measured equal with 2 and 4 micro-batches, fp32 and bf16, ZeRO-3)."""
    return dims.pp == 1 and cfg.parallel.compression == "none"


def _traced_microbatches(cfg, dims, rank: int, M: int) -> int:
    """How many of a step's M micro-batches a trace that keeps no collectives runs: where they
    stand for all (no compression's per-step products), the first alone without a pipeline
    (`first_stands_for_all`), with one as many as the rank's stage holds at its fullest
    (`pipeline.fewest_microbatches`: a 1F1B stage at most its distance from the last, plus one;
    GPipe all); else all."""
    if M == 1 or cfg.parallel.compression != "none":
        return M
    if first_stands_for_all(cfg, dims):
        return 1
    return fewest_microbatches(cfg.parallel, dims.pp, M, dims.coords(rank)["pp"])


def trace_rank(cfg, dims, rank: int, device: str = "cpu", first_only: bool = False) -> RankTrace:
    """The training step of rank `rank` of the configuration `cfg` (a `plait.config.schema.Config`)
    on `dims`, as `plait train` would run it: the model it names, built on `meta` and faked, placed
    and wrapped by `parallelize`, fed this rank's rows of a global batch of token windows as the
    trainer cuts them (inputs and targets views of one (rows, seq + 1) tensor; and the inputs'
    documents under `data.document_mask`: the masks' shapes, whatever their values). `first_only`:
    the fewest micro-batches that stand for all of them (`_traced_microbatches`; the name is
    older than pipelines' share of it), their FLOPs scaled to the step's, and no collectives."""

    M = microbatches(cfg.parallel, dims)
    run = _traced_microbatches(cfg, dims, rank, M) if first_only else M
    meta = cfg.model.build(cfg.train.seed, "meta")
    with fake_world(rank, dims.world_size):
        mesh = build_mesh(dims, torch.device(device).type)
        with FakeTensorMode() as mode:
            parallelized = parallelize(fake_module(meta, device, mode), mesh, cfg.parallel, Options(
                microbatches=run, precision=cfg.train.precision,
                param_dtype=cfg.train.param_dtype,
                activation_checkpointing=cfg.train.activation_checkpointing,
                scaler=LossScaler.of(cfg.train)))
            _, rows = rows_share(parallelized.axes)
            window = torch.empty(cfg.train.global_batch // rows, cfg.data.seq_len + 1,
                                 dtype=torch.int64, device=device)
            documents = torch.empty_like(window[:, :-1]) if cfg.data.document_mask else None
            batches = parallelized.split(window[:, :-1], window[:, 1:], M, documents)
            if run == M:
                return trace_step(parallelized, batches)
            fewer = trace_step(parallelized, batches[:run])
            return RankTrace(fewer.activation_bytes, fewer.flops * M // run,  # no collectives
                             fewer.recomputed_flops * M // run)
