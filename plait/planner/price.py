"""One layout priced: its memory per stage, its step time and what it communicates (the model
the package's docstring describes)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from plait.comm import Op
from plait.config.schema import Config, ModelConfig, ParallelConfig, microbatches
from plait.mesh import AXES, Axis, ParallelDims, batch_axis, dp_per_node
from plait.model.shape import Shape
from plait.parallel import place
from plait.parallel.pipeline.simulator import bubble_formula
from plait.parallel.pipeline.stage import chunk_sizes
from plait.planner import gemm
from plait.planner.hardware import Cluster
from plait.predict import cost
from plait.predict.activations import (
    activation_bytes,
    loss_backward_bytes,
    microbatch_bytes,
    regathered_bytes,
)
from plait.predict.cost import ChunkLayout, routed_traffic
from plait.predict.trace import Untraceable, trace_class

# Of device memory a plan may use: the rest for the CUDA context, communication buffers and the
# caching allocator's fragmentation. Published runs held up to 94.5% of the device as PyTorch's
# reserved memory (torchtitan's 8B at 256K tokens: 84.5 of 89.4 GiB; bench/published.py).
HEADROOM = 0.95
# Message steps of a ring collective on n ranks, in units of n - 1 (send: one step).
STEPS = {Op.ALL_REDUCE: 2, Op.ALL_GATHER: 1, Op.REDUCE_SCATTER: 1, Op.ALL_TO_ALL: 1}
DEGREES = ("dp", "dp_shard", "tp", "pp", "cp", "ep", "zero", "cp_method", "microbatches",
           "pp_schedule", "activation_checkpointing", "sequence_parallel", "offload")


@dataclass
class PricedLayout:
    degrees: dict
    params: int
    memory_bytes: dict  # rank 0: params, grads, optimizer (end of step), the model state's peak
    # during the step, activations, total (end of step + activations)
    peak_memory_bytes: int  # the worst stage's device bytes at their most: what must fit
    step_time_s: float
    tokens_per_s: float
    mfu: float
    bubble: float
    comm_bytes: float  # rank 0, per step
    comm_s: float = 0.0  # the slowest stage's communication not hidden by compute, per step
    startup_bytes: int = 0  # the worst stage's device bytes while it builds its part
    host_memory_bytes: int = 0  # per node: what offload keeps in host memory
    compile_s: float = 0.0  # before the first step: compiling each distinct block of a stage
    warnings: list[str] = field(default_factory=list)
    fits: bool = True

    def as_json(self) -> dict:
        return {**self.degrees, **{k: v for k, v in dataclasses.asdict(self).items()
                                   if k != "degrees"}}


@functools.lru_cache(maxsize=16)
def _meta_model(model: ModelConfig):
    """The model on `meta` (plait's Llama, or a Hugging Face folder's own modules), built once
    for what only reads it."""
    return model.build(0, "meta")


@functools.lru_cache(maxsize=1024)
def _sizes(model: ModelConfig, chunks: int, split: tuple) -> tuple[int, ...]:
    """Layers per pipeline chunk, as `apply_pp` cuts them."""
    if chunks == 1:
        return (model.shape().layers,)
    return split or tuple(chunk_sizes(_meta_model(model), chunks))


@functools.lru_cache(maxsize=1024)
def _stages(shape: Shape, pp: int, sizes: tuple) -> list[tuple[list[ChunkLayout], tuple]]:
    """Per stage, its chunks as the formulas see them (chunk c on stage c % pp) and its kind:
    what its model state and traffic depend on (per chunk which of its blocks are MoE, whether
    it holds the embedding, the head, which neighbours it sends to). Stages of one kind price
    alike: a 64-stage pipeline has three or four kinds."""
    C, out = len(sizes), []
    starts = [sum(sizes[:c]) for c in range(C)]
    for stage in range(pp):
        chunks, kind = [], []
        for c in range(stage, C, pp):
            moe = tuple(shape.is_moe(i) for i in range(starts[c], starts[c] + sizes[c]))
            chunks.append(ChunkLayout(c, sizes[c], c == 0, c == C - 1, sum(moe)))
            kind.append((moe, c == 0, c == C - 1, c > 0, c < C - 1))
        out.append((chunks, tuple(kind)))
    return out


@functools.lru_cache(maxsize=1024)
def _placed(model: ModelConfig, pp: int, tp: int, ep: int, sizes: tuple, stage: int,
            sp: bool = False, wrap: str = ""):
    """One stage's placement record (what the formulas need), the chunks cut as `sizes` says;
    `sp`: sequence parallelism (which parameters' gradients are partial over tp); `wrap`:
    ZeRO-3's units where they are not the plan's blocks (`parallel.wrap`)."""

    virtual = len(sizes) // pp
    par = ParallelConfig(pp=pp, tp=tp, ep=ep, pp_schedule="interleaved" if virtual > 1 else "1f1b",
                         pp_virtual=virtual, pp_split=list(sizes) if len(sizes) > 1 else [],
                         sequence_parallel=sp and tp > 1, wrap=wrap)
    degrees = {"pp": pp, "tp": tp, "ep": ep}
    axes = {a: Axis.dry(a, stage if a == "pp" else 0, degrees.get(a, 1)) for a in AXES}
    axes["batch"] = batch_axis(axes)
    _, _, record = place(model.build(0, "meta"), axes, par, pp)  # it cuts it
    return record


def _group_shape(dims: ParallelDims, group: str, node: int = 1) -> tuple[int, int]:
    """(stride, size) on the row-major mesh of a group the traffic names; `node`: the dp ranks
    on one node, which the hierarchical all-reduce's groups ("dp_node", "dp_nodes") split dp by."""
    stride = {a: 1 for a in AXES}
    for inner, outer in zip(AXES[::-1], AXES[::-1][1:], strict=False):
        stride[outer] = stride[inner] * getattr(dims, inner)
    K = dims.shard
    return {"dp_shard": (stride["ep"], dims.shard_ranks),  # K dp ranks x cp x ep, in a run
            "dp_shard_experts": (stride["dp"], K), "dp_replicate": (stride["dp"] * K, dims.dp // K),
            "dp_node": (stride["ep"], node * dims.cp * dims.ep),  # its dp ranks x cp x ep
            "dp_node_experts": (stride["dp"], node),
            "dp_nodes": (stride["dp"] * node, dims.dp // node),
            "batch": (stride["ep"], dims.batch)}.get(  # dp x cp x ep: one run of stride tp
        group, (stride.get(group, 1), getattr(dims, group, 1)))


def _comm_seconds(traffic, dims: ParallelDims, cluster: Cluster, node: int = 1,
                  only: Op | None = None) -> dict[str, float]:
    """Seconds per group: each call's latency steps plus its bytes over the group's link (`only`:
    of that collective alone). gloo reduce-scatters by all-reducing (twice the steps and bytes;
    `plait bench topology` measured it so)."""
    out = {}
    for group, ops in traffic.groups.items():
        stride, size = _group_shape(dims, group, node)
        bandwidth, alpha = cluster.link(stride, size)
        out[group] = 0.0
        for op, (calls, moved) in ops.items():
            if only is not None and op != only:
                continue
            if op == Op.REDUCE_SCATTER and cluster.device.gloo:
                op, moved = Op.ALL_REDUCE, 2 * moved
            out[group] += calls * STEPS.get(op, 1) * (size - 1) * alpha + float(moved) / bandwidth
    return out


def cpu_compute_seconds(flops: float, device, passes: float = 1.0) -> float:
    """A calibrated CPU's compute: `flops` at its measured matmul rate times the share a step
    reaches, plus its overheads per step and per pass of a micro-batch through the whole model
    (`passes`)."""
    return (flops / (device.peak_flops * device.efficiency) + device.step_overhead_s
            + device.microbatch_overhead_s * passes)


def gpu_compute_seconds(cfg: Config, dims: ParallelDims, record, chunks, flops: float,
                        state: dict, cluster: Cluster) -> float:
    """A GPU's compute for one step of this stage's rank (`planner.gemm`): its `flops` (executed,
    recomputation and the optimizer's matmuls included) at the rate of its own linear layers'
    shapes, attention at the fused kernel's rate for the sequence, the elementwise work by the
    bytes of its activations and the optimizer by its state's slice, at the memory's rate."""
    M = microbatches(cfg.parallel, dims)
    device, engine = cluster.device, cluster.engine
    rows = max(1, cfg.train.global_batch // dims.rows // M)
    tokens = rows * cfg.data.seq_len // dims.cp
    routed = _routed(cfg.model.shape(), dims)
    recompute = cfg.train.activation_checkpointing
    # Full recomputation runs each block's forward again; the head's is not repeated.
    weights = [(*_local_matrix(p), routed if ".experts." in name else 1.0,
                engine.fp8 and not _is_head(name), recompute == "full" and not _is_head(name))
               for name, p in record.params.items()
               if len(p.shape) == 2 and "embed" not in name]
    attention = _attention_per_token(cfg, dims, chunks) * tokens * M
    attention *= 4 / 3 if recompute in ("full", "selective") else 1
    seconds = (flops - attention) / gemm.matmul_rate(weights, tokens, device)
    kernel = engine.attention_kernel if device.hopper else 1.0
    seconds += attention / (gemm.attention_rate(cfg.data.seq_len, device) * kernel)
    plain = with_degrees(cfg, activation_checkpointing="none")
    # Compiled blocks fuse their elementwise work, and the loss fused with the head its own
    # (`vocab_parallel.compiled_kernels`); the embedding's lookup is the same few bytes either way.
    moved = elementwise_passes(cfg, engine) * sum(
        microbatch_bytes(plain, dims, c.layers, c.first, c.last, rows, c.moe, priced=True)
        for c in chunks)
    if engine.autocast:
        moved += sum(regathered_bytes(plain, dims, rows, c.layers, c.moe) for c in chunks)
    moved *= 4 / 3 if recompute == "full" else 1  # the forward's share again
    moved += sum(gemm.fp8_cast_bytes(out, inner, tokens * share) * (4 / 3 if again else 1)
                 for out, inner, share, fp8, again in weights if fp8)
    param_b, _ = cost.dtype_bytes(cfg)
    elements = state["optimizer"] // (12 if param_b == 2 else 8)
    return seconds + gemm.memory_seconds(M * moved + elements * engine.optimizer_bytes, device)


def compiled(cfg: Config, engine) -> bool:
    """Whether the engine's blocks are priced compiled: `train.compile` on a GPU ("auto": on),
    where the engine models it."""
    return engine.compiled_passes is not None and (cfg.train.compile == "auto"
                                                   or cfg.train.compile is True)


def elementwise_passes(cfg: Config, engine) -> float:
    return engine.compiled_passes if compiled(cfg, engine) else engine.elementwise_passes


def _is_head(name: str) -> bool:
    """The output head (plait's Llama `output`, transformers' `lm_head`): torchtitan's float8
    training leaves it in bf16."""
    return name.startswith(("output.", "lm_head."))


def _local_matrix(place) -> tuple[int, int]:
    """(out, in) of a weight as this rank's matmul sees it: split by tp and ep only (ZeRO's
    shards are gathered before use)."""
    shape = list(place.shape)
    for axis, shard in place.shards.items():
        if axis in ("tp", "ep") and shard.dim is not None:
            shape[shard.dim] //= shard.count
    return shape[0], shape[1]


def stage_seconds(compute: float, traffic, zero: int, dims: ParallelDims, cluster: Cluster,
                  node: int = 1, bubble: float = 0.0,
                  host: tuple[float, float] = (0.0, 0.0),
                  unprefetched: float = 0.0) -> tuple[float, float]:
    """(step seconds, communication seconds not hidden) of a rank that computes for `compute`
    seconds and moves `traffic` (a `cost.Traffic`) in a step: tensor-, pipeline-, context- and
    expert-parallel traffic on the critical path, data-parallel reductions hidden behind the
    backward (ZeRO-3: the whole step) as far as it lasts where the engine overlaps them
    (`Engine.overlap_dp`), ZeRO-1/2's all-gather after the step exposed; a pipeline's `bubble`
    stretching the pipelined part; `host`: offload's seconds on the critical path and those that
    hide like data-parallel traffic; `unprefetched`: ZeRO-3's share of the gathers no prefetch
    starts ahead (`cost.unprefetched_share`), exposed."""
    dev = cluster.device
    comm = _comm_seconds(traffic, dims, cluster, node)
    data = sum(t for g, t in comm.items() if g.startswith("dp") or g == "batch")
    # ZeRO-1/2 all-gather the updated parameters after the optimizer step (`zero.finish_step`):
    # nothing is left to hide them behind.
    after = sum(_comm_seconds(traffic, dims, cluster, node, Op.ALL_GATHER).get(g, 0.0)
                for g in comm if g.startswith("dp")) if zero in (1, 2) else 0.0
    data -= after
    # ZeRO-3's units gathered when they run, not before (each pass's first in a chunk, those
    # `max_live_params` holds back): nothing computes beside their transfer.
    first = unprefetched * sum(_comm_seconds(traffic, dims, cluster, node, Op.ALL_GATHER)
                               .get(g, 0.0) for g in comm if g.startswith("dp")) \
        if zero == 3 else 0.0
    data += host[1] - first  # parameter slices copied in before their gathers
    overlap = dev.overlap and cluster.engine.overlap_dp
    hidden = 0.0 if not overlap else compute if zero == 3 else compute * 2 / 3
    exposed = sum(t for g, t in comm.items() if g in ("tp", "pp", "cp", "ep"))
    waited = exposed / (1 - bubble) + max(0.0, data - hidden) + after + first
    return compute / (1 - bubble) + waited + host[0], waited


def traced_stage(cfg: Config, dims: ParallelDims, stage: int):
    """A Hugging Face model's step on the first rank of `stage`, traced on fake tensors (its own
    operations: `plait.predict.trace`); None where it cannot be (then plait's Llama formulas of
    the same shape price it, and the plan says so)."""
    if not cfg.model.hf:
        return None
    try:
        return trace_class(cfg, dims, dims.rank(pp=stage))
    except Untraceable:
        return None


def _activations(cfg: Config, dims: ParallelDims, chunks, stage: int) -> int:
    traced = traced_stage(cfg, dims, stage)
    return traced.activation_bytes if traced else activation_bytes(cfg, dims, chunks)


def _flops(cfg: Config, dims: ParallelDims, record, chunks,
           stage: int = 0) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs incl. recomputation) of one step on this stage's rank."""
    traced = traced_stage(cfg, dims, stage)
    if traced is not None:  # the model's own; the model FLOPs are those less recomputation's
        return float(traced.flops - traced.recomputed_flops), float(traced.flops)
    tokens = cfg.train.global_batch * cfg.data.seq_len / dims.batch
    routed = _routed(cfg.model.shape(), dims)
    matmul = {n: p.local_numel * (routed if ".experts." in n else 1)
              for n, p in record.params.items() if not n.startswith("tok_embeddings")}
    attention = _attention_per_token(cfg, dims, chunks)
    model = tokens * (6 * sum(matmul.values()) + attention)
    blocks = sum(v for n, v in matmul.items() if not _is_head(n))  # what "full" runs again
    extra = {"full": tokens * (2 * blocks + attention / 3),  # the blocks' forward once more
             "selective": tokens * attention / 3}.get(cfg.train.activation_checkpointing, 0.0)
    return model, model + extra


def _routed(shape: Shape, dims: ParallelDims) -> float:
    """The share of its ep group's tokens an expert's weights see: top_k / E of the ep ranks'."""
    return shape.top_k * dims.ep / shape.experts if shape.experts else 1.0


def _attention_per_token(cfg: Config, dims: ParallelDims, chunks) -> float:
    """FLOPs per token of this rank's attention scores and weighted sums in a step, forward and
    backward (PaLM's 12 s dim per layer, tp splitting the heads)."""
    layers = sum(c.layers for c in chunks)
    return 12 * layers * cfg.data.seq_len * cfg.model.shape().hidden / dims.tp


def estimate(cfg: Config, dims: ParallelDims, cluster: Cluster) -> PricedLayout:
    """Price one configuration (validated for dims.world_size)."""
    if not cluster.device.gloo and cfg.train.device != "cuda":  # the engine's GPU path
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device="cuda"))
    cfg = engine_zero3(cfg, cluster.engine)
    par, dev, shape = cfg.parallel, cluster.device, cfg.model.shape()
    M = microbatches(par, dims)
    schedule = par.pp_schedule if dims.pp > 1 else "1f1b"
    virtual = par.pp_virtual if schedule == "interleaved" else 1
    bubble = bubble_formula(schedule, dims.pp, M, virtual) if dims.pp > 1 else 0.0
    sizes = _sizes(cfg.model, dims.pp * virtual, tuple(par.pp_split))
    priced, per_stage, step, comm_s = {}, [], 0.0, 0.0
    node = dp_per_node(dims, par.ranks_per_node or cluster.per_node)  # hierarchical's groups
    for stage, (chunks, kind) in enumerate(_stages(shape, dims.pp, sizes)):
        if kind not in priced:
            record = _placed(cfg.model, dims.pp, dims.tp, dims.ep, sizes, stage,
                             par.sequence_parallel, par.wrap if par.zero == 3 else "")
            traffic = cost.step_traffic(cfg, dims, record, chunks)
            routed_traffic(traffic, cfg, dims, chunks)
            model_flops, flops = _flops(cfg, dims, record, chunks, stage)
            flops += cost.muon_flops(cfg, dims, record, slowest=True)  # the optimizer's
            share = sum(c.layers for c in chunks) / shape.layers  # of the model on this stage
            state = cost.state_bytes(cfg, dims, record)
            offloaded, host_s, hidden_host_s = _offload(state, cfg, dims, cluster)
            compute = cpu_compute_seconds(flops, dev, M * share) if dev.gloo else \
                gpu_compute_seconds(cfg, dims, record, chunks, flops, state, cluster)
            time, waited = stage_seconds(compute, traffic, par.zero, dims, cluster, node,
                                         bubble, (host_s, hidden_host_s),
                                         cost.unprefetched_share(cfg, dims, record))
            priced[kind] = (state, traffic, model_flops, time, offloaded,
                            cost.startup_bytes(cfg, dims, record), waited)
        state, traffic, model_flops, time, offloaded, startup, waited = priced[kind]
        if time > step:
            step, comm_s = time, waited
        # The last chunk's fused loss: its backward's logits and head gradient, on top.
        loss = loss_backward_bytes(cfg, dims) if any(c.last for c in chunks) and \
            not cfg.model.hf else 0
        per_stage.append((state, _activations(cfg, dims, chunks, stage), traffic, model_flops,
                          offloaded, startup, loss))
    state, act, traffic, *_ = per_stage[0]
    memory = {**{k: state[k] for k in ("params", "grads", "optimizer", "peak")},
              "activations": act}
    memory["total"] = sum(v for k, v in state.items() if k != "peak") + act
    # On the device: the step's peak and activations, less what offload keeps in host memory;
    # and, before the first step, what building the rank's part of the model takes.
    peak = max(s["peak"] - off + a + loss for s, a, _, _, off, _, loss in per_stage)
    startup = max(st for *_, st, _ in per_stage)
    host = cluster.per_node * max(off for *_, off, _, _ in per_stage)
    model_flops = sum(f[3] for f in per_stage) * dims.batch * dims.tp
    tokens = cfg.train.global_batch * cfg.data.seq_len
    fits = max(peak, startup) <= HEADROOM * dev.memory_bytes and \
        host <= HEADROOM * dev.host_memory_bytes
    return PricedLayout(degrees=layout_degrees(cfg, dims), params=_count(cfg.model),
                memory_bytes=memory, peak_memory_bytes=max(peak, startup), step_time_s=step,
                tokens_per_s=tokens / step,
                mfu=model_flops / step / (dims.world_size * dev.peak_flops), bubble=bubble,
                comm_bytes=float(traffic.total), comm_s=comm_s, startup_bytes=startup,
                host_memory_bytes=host, fits=fits,
                compile_s=0.0 if dev.gloo else _compile_seconds(cfg, dims, cluster.engine, shape,
                                                                  sizes))


def engine_zero3(cfg: Config, engine) -> Config:
    """ZeRO-3 as the engine runs it where the run leaves it to the engine (no `parallel.wrap`, no
    `parallel.max_live_params`): the engine's units and its bound on live gathered parameters
    (`Engine.zero3_wrap`, `Engine.max_live_params`)."""
    par = cfg.parallel
    if par.zero != 3 or par.wrap or par.max_live_params or \
            not (engine.zero3_wrap or engine.max_live_params):
        return cfg
    return dataclasses.replace(cfg, parallel=dataclasses.replace(
        par, wrap=engine.zero3_wrap, max_live_params=engine.max_live_params))


def _compile_seconds(cfg: Config, dims: ParallelDims, engine, shape: Shape,
                     sizes: tuple) -> float:
    """Compiling the blocks before the first step, on a GPU: each distinct block of a stage once
    (dense and mixture-of-experts blocks are two), the stages at once."""
    if not compiled(cfg, engine):
        return 0.0
    distinct = [any(c.moe < c.layers for c in chunks) + any(c.moe for c in chunks)
                for chunks, _ in _stages(shape, dims.pp, sizes)]
    return engine.compile_s * max(distinct)


def _offload(state: dict, cfg: Config, dims: ParallelDims,
             cluster: Cluster) -> tuple[int, float, float]:
    """(bytes offload keeps in host memory per rank, seconds it adds to the step on the critical
    path, seconds of copies that can hide behind compute). "optimizer" (ZeRO-Offload): the fp32
    masters and moments in host memory; per step the gradient slice goes down and the updated
    parameter slice comes back over PCIe, and the CPU runs AdamW (memory-bound: 32 bytes per
    element at the node's host bandwidth shared by its GPUs, or at what the rank's
    `train.threads` threads reach, whichever is less). "params" (ZeRO-3): the parameter slices
    too, each copied to the device before each of its gathers."""
    par, dev = cfg.parallel, cluster.device
    if par.offload == "none":
        return 0, 0.0, 0.0
    param_b, reduce_b = cost.dtype_bytes(cfg)
    sliced = state["optimizer"] // (12 if param_b == 2 else 8)  # elements of this rank's slices
    pcie = dev.pcie_gbps * 1e9
    cpu = sliced * 32 / min(dev.host_gbps * 1e9 / cluster.per_node,
                            dev.host_thread_gbps * 1e9 * cfg.train.threads)
    host, seconds = state["optimizer"], sliced * (reduce_b + param_b) / pcie + cpu
    hidden = 0.0
    if par.offload == "params":
        host += state["params"]  # ZeRO-3's slices at the end of a step
        gathers = 1 if not par.reshard_after_forward else 2 * microbatches(par, dims)
        hidden = gathers * state["params"] / pcie
    return host, seconds, hidden


@functools.lru_cache(maxsize=64)
def _count(model: ModelConfig) -> int:
    return sum(p.numel() for p in _meta_model(model).parameters())


def layout_degrees(cfg: Config, dims: ParallelDims) -> dict:
    par = cfg.parallel
    return {"dp": dims.dp, "dp_shard": par.dp_shard, "tp": dims.tp, "pp": dims.pp,
            "cp": dims.cp, "ep": dims.ep, "zero": par.zero, "cp_method": par.cp_method,
            "microbatches": microbatches(par, dims), "pp_schedule": par.pp_schedule,
            "pp_virtual": par.pp_virtual if dims.pp > 1 and par.pp_schedule == "interleaved"
            else 1,
            "activation_checkpointing": cfg.train.activation_checkpointing,
            "sequence_parallel": par.sequence_parallel, "offload": par.offload}


def with_degrees(cfg: Config, **degrees) -> Config:
    """cfg with the given plan degrees (train.activation_checkpointing among them)."""
    train = {k: v for k, v in degrees.items() if k == "activation_checkpointing"}
    par = {k: v for k, v in degrees.items() if k not in train}
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **par),
                               train=dataclasses.replace(cfg.train, **train))
