"""The checks of a configuration's model, layout and training keys (`check_layout`), made before
a worker starts and by the planner for every layout it prices: they read no file but a Hugging
Face folder's. Each raises `ConfigError(field, fix)`; the CLI turns it into exit status 2 and
one line. What a run reads from disk is checked by `data/checks.py` and `checkpoint/checks.py`;
`plait.train.checks.validate` runs them all."""

from __future__ import annotations

import dataclasses
import math

from plait.config.checks_hf import check_hf
from plait.config.checks_train import check_train
from plait.config.choices import (
    COMPRESSIONS,
    CP_METHODS,
    HALF_PRECISIONS,
    PP_SCHEDULES,
    ROUTERS,
    WITH_ERROR_FEEDBACK,
)
from plait.config.schema import (
    Config,
    ConfigError,
    ParallelConfig,
    microbatches,
)
from plait.mesh import AXES, ParallelDims, dp_per_node, ranks_per_node
from plait.model.llama_plan import LLAMA, MODULE_CLASSES
from plait.model.plan import tp_misfit
from plait.model.shape import Shape


def check_layout(cfg: Config, world_size: int) -> ParallelDims:
    """Check the model, the layout and the training keys; return the resolved mesh degrees."""
    dims = _resolve_dims(cfg.parallel, world_size)
    if cfg.model.hf:
        check_hf(cfg, dims)
    _check_model(cfg)
    # An HF family's plan: check_hf's.
    misfit = None if cfg.model.hf else tp_misfit(LLAMA, cfg.model.args(), dims.tp)
    if misfit:
        raise ConfigError("parallel.tp", misfit)
    if cfg.parallel.sequence_parallel and cfg.data.seq_len % (dims.tp * dims.cp):
        raise ConfigError(
            "parallel.sequence_parallel",
            f"tp={dims.tp}" + (f" x cp={dims.cp}" if dims.cp > 1 else "") + " must divide "
            f"data.seq_len={cfg.data.seq_len} to split the sequence",
        )
    _check_pipeline(cfg, dims, cfg.model.shape())
    dims = _check_hybrid(cfg.parallel, dims)
    _check_context(cfg, dims, cfg.model.shape())
    _check_moe(cfg, dims, cfg.model.shape())
    _check_parallel(cfg.parallel, cfg.train.precision)
    _check_llama_wrap(cfg)
    _check_nodes(cfg.parallel, dims)
    _check_compression(cfg.parallel, dims)
    check_train(cfg.train, dims)
    if cfg.train.optimizer == "muon" and cfg.parallel.offload != "none":
        raise ConfigError("train.optimizer", "Muon orthogonalizes on the device and offload "
                          "keeps the optimizer in host memory: use parallel.offload = 'none'")
    if cfg.train.optimizer == "muon" and cfg.parallel.zero == 0 \
            and cfg.train.param_dtype in HALF_PRECISIONS:
        raise ConfigError("train.param_dtype", f"'{cfg.train.param_dtype}' parameters under "
                          "parallel.zero = 0 keep flat fp32 masters, and Muon steps whole "
                          "matrices there: use parallel.zero >= 1 (the same masters), or 'auto'")
    return dims


def validate_parallel(par: ParallelConfig, world_size: int,
                      precision: str = "fp32") -> ParallelDims:
    """The checks of the `parallel` section alone (the Python API: the model and data are the
    user's); the resolved mesh degrees."""
    dims = _check_hybrid(par, _resolve_dims(par, world_size))
    _check_parallel(par, precision)
    _check_nodes(par, dims)
    _check_compression(par, dims)
    return dims


def _resolve_dims(par: ParallelConfig, world_size: int) -> ParallelDims:
    for axis in AXES:
        degree = getattr(par, axis)
        if degree < (0 if axis == "dp" else 1):
            raise ConfigError(f"parallel.{axis}", f"degree must be >= 1, got {degree}")
    if world_size < 1:
        raise ConfigError("--nproc", f"need at least one process, got {world_size}")
    others = math.prod(getattr(par, a) for a in AXES if a != "dp")
    dp = par.dp or world_size // others
    if par.dp == 0 and (others > world_size or world_size % others):
        text = " * ".join(f"{a}={getattr(par, a)}" for a in AXES if a != "dp")
        raise ConfigError("parallel", f"{text} = {others} must divide the world size "
                          f"{world_size} (parallel.dp=0 takes the rest); change the degrees or "
                          "--nproc")
    if dp * others != world_size:
        text = " * ".join(f"{a}={getattr(par, a) if a != 'dp' else dp}" for a in AXES)
        raise ConfigError(
            "parallel",
            f"{text} must equal the world size {world_size}; change the degrees or --nproc",
        )
    return ParallelDims(**{a: getattr(par, a) for a in AXES if a != "dp"}, dp=dp)


def _check_pipeline(cfg: Config, dims: ParallelDims, shape: Shape) -> None:
    par = cfg.parallel
    if par.pp_schedule not in PP_SCHEDULES:
        raise ConfigError("parallel.pp_schedule",
                          f"one of {', '.join(PP_SCHEDULES)}; got '{par.pp_schedule}'")
    m = microbatches(par, dims)
    rows = cfg.train.global_batch // dims.rows
    if m < 1 or rows % m:
        raise ConfigError("parallel.microbatches",
                          f"{m} must divide the {rows} sequences per data-parallel rank")
    if dims.pp == 1:
        return
    if par.pp_schedule == "zb1" and cfg.train.activation_checkpointing != "none":
        raise ConfigError("train.activation_checkpointing",
                          "zb1 walks each graph twice (input, then weight gradients), which "
                          "torch's checkpoint cannot recompute twice; use another pp_schedule "
                          "or set it to 'none'")
    chunks = dims.pp
    if par.pp_schedule == "interleaved":
        if par.pp_virtual < 1 or m % dims.pp:
            raise ConfigError("parallel.microbatches", f"interleaved needs a multiple of pp="
                              f"{dims.pp} micro-batches (got {m}) and pp_virtual >= 1")
        chunks *= par.pp_virtual
    if shape.layers < chunks:
        raise ConfigError("parallel.pp", f"{chunks} pipeline chunks need >= {chunks} layers")
    split = par.pp_split
    if split and (len(split) != chunks or sum(split) != shape.layers or min(split) < 1):
        raise ConfigError("parallel.pp_split", f"{chunks} positive layer counts summing to "
                          f"the model's {shape.layers} layers, got {split}")


def _check_hybrid(par: ParallelConfig, dims: ParallelDims) -> ParallelDims:
    if par.dp_shard < 0 or (par.dp_shard and dims.dp % par.dp_shard):
        raise ConfigError("parallel.dp_shard",
                          f"{par.dp_shard} must divide dp={dims.dp} (0: shard over all of dp)")
    if par.dp_shard and par.dp_shard < dims.dp and not par.zero:
        raise ConfigError("parallel.dp_shard", "hybrid sharding shards ZeRO state; set "
                          "parallel.zero to 1, 2 or 3, or leave dp_shard at 0")
    return dataclasses.replace(dims, dp_shard=par.dp_shard or dims.dp)


def _check_llama_wrap(cfg) -> None:
    """`parallel.wrap`'s class names against plait's Llama's (a Hugging Face family's are checked
    against its modeling module, `checks_hf`)."""
    wrap = cfg.parallel.wrap
    if not wrap or wrap.isdigit() or cfg.model.hf:
        return
    missing = [n.strip() for n in wrap.split(",") if n.strip() not in MODULE_CLASSES]
    if missing:
        raise ConfigError("parallel.wrap", f"plait's Llama has no module class "
                          f"{', '.join(missing)}; its classes: {', '.join(MODULE_CLASSES)}")


def _check_live(par: ParallelConfig) -> None:
    if par.max_live_params < 0:
        raise ConfigError("parallel.max_live_params", "a number of parameter elements, 0 for no "
                          f"bound, got {par.max_live_params}")
    if par.max_live_params and par.zero != 3:
        raise ConfigError("parallel.max_live_params", "it bounds what ZeRO-3 prefetches: set "
                          "parallel.zero = 3, or leave it 0")
    if par.max_live_params and not par.reshard_after_forward:
        raise ConfigError("parallel.max_live_params", "with parallel.reshard_after_forward = "
                          "false every unit stays gathered through the step, which no bound "
                          "lowers: set one of them back")


def _check_parallel(par: ParallelConfig, precision: str) -> None:
    if par.zero not in (0, 1, 2, 3):
        raise ConfigError("parallel.zero", f"a ZeRO stage is 0, 1, 2 or 3, got {par.zero}")
    names = [n.strip() for n in par.wrap.split(",")] if par.wrap else []
    if names and not (par.wrap.isdigit() and int(par.wrap) > 0) \
            and not all(n.isidentifier() for n in names):
        raise ConfigError("parallel.wrap", f"module class names separated by commas (e.g. "
                          f"'GPT2Block') or a positive parameter count, got {par.wrap!r}")
    _check_live(par)
    if par.reduce_dtype not in ("fp32", *HALF_PRECISIONS):
        raise ConfigError("parallel.reduce_dtype",
                          f"'fp32', 'bf16' or 'fp16', got '{par.reduce_dtype}'")
    if par.reduce_dtype != "fp32" and par.reduce_dtype != precision:
        raise ConfigError("parallel.reduce_dtype", f"'{par.reduce_dtype}' reduces in the half "
                          f"dtype of train.precision, which is '{precision}': use 'fp32'"
                          + (f" or '{precision}'" if precision in HALF_PRECISIONS else ""))
    if par.offload not in ("none", "optimizer", "params"):
        raise ConfigError(
            "parallel.offload", f"'none', 'optimizer' or 'params', got '{par.offload}'"
        )
    if par.offload != "none" and not par.zero:
        raise ConfigError("parallel.offload", "offload shards through ZeRO; set parallel.zero")
    if par.offload == "params" and par.zero != 3:
        raise ConfigError("parallel.offload", "'params' needs parallel.zero=3 (sharded params)")
    if par.timeout_s <= 0:
        raise ConfigError("parallel.timeout_s", f"must be > 0 seconds, got {par.timeout_s}")
    if par.bucket_mb <= 0:
        raise ConfigError("parallel.bucket_mb", f"must be > 0, got {par.bucket_mb}")
    if par.allreduce not in ("backend", "ring", "naive", "hierarchical"):
        raise ConfigError("parallel.allreduce", "'backend', 'ring', 'naive' or 'hierarchical', "
                          f"got '{par.allreduce}'")
    if par.ranks_per_node < 0:
        raise ConfigError("parallel.ranks_per_node",
                          f"must be >= 0 (0: the launcher's), got {par.ranks_per_node}")


def _check_nodes(par: ParallelConfig, dims: ParallelDims) -> None:
    """Nodes of whole tensor-parallel groups; the hierarchical all-reduce's conditions."""
    node = ranks_per_node(par.ranks_per_node, dims.world_size)
    key = "parallel.ranks_per_node"
    if dims.world_size % node:
        raise ConfigError(key, f"{node} ranks per node must divide the world size "
                          f"{dims.world_size}")
    if par.allreduce != "hierarchical":
        return
    if par.zero:
        raise ConfigError("parallel.allreduce", "'hierarchical' reduces DDP's gradients "
                          "(zero = 0); ZeRO's hierarchy is hybrid sharding (parallel.dp_shard)")
    if node % (dims.cp * dims.ep * dims.tp) or dims.dp % dp_per_node(dims, node):
        raise ConfigError(key, f"'hierarchical' needs nodes of whole tensor-parallel groups "
                          f"whose dp ranks divide dp={dims.dp}: {node} ranks per node with "
                          f"tp={dims.tp} does not")


def _check_compression(par: ParallelConfig, dims: ParallelDims) -> None:
    field, method = "parallel.compression", par.compression
    if method not in COMPRESSIONS:
        raise ConfigError(field, f"one of {', '.join(COMPRESSIONS)}; got '{method}'")
    for key, ok, want in (("ratio", 0 < par.compression_ratio <= 1, "a fraction in (0, 1]"),
                          ("rank", par.compression_rank >= 1, "must be >= 1"),
                          ("start", par.compression_start >= 0, "must be >= 0 steps")):
        if not ok:
            raise ConfigError(f"{field}_{key}", f"{want}, got {getattr(par, f'compression_{key}')}")
    why = None
    if method != "none" and par.zero == 3 and method in WITH_ERROR_FEEDBACK:
        why = (f"'{method}' keeps a full-size error-feedback copy of every gradient per rank, "
               "which ZeRO-3 exists not to hold; use parallel.zero <= 2, or fp16, bf16 or int8")
    elif method not in ("none", "fp16", "bf16", "int8") and dims.shard < dims.dp:
        why = (f"hybrid sharding compresses the all-reduce of its slices across the replicas, "
               f"elementwise: fp16, bf16 or int8, not '{method}' (or leave parallel.dp_shard "
               "at 0)")
    elif method != "none" and par.allreduce != "backend":
        why = (f"a method chooses its own collectives; parallel.allreduce='{par.allreduce}' is "
               "for uncompressed all-reduces: set one")
    elif method != "none" and par.zero and par.reduce_dtype != "fp32":
        why = (f"parallel.reduce_dtype='{par.reduce_dtype}' already compresses the reduction: "
               "set it to 'fp32'")
    if why:
        raise ConfigError(field, why)


def _check_moe(cfg: Config, dims: ParallelDims, shape: Shape) -> None:
    e, par = shape.experts, cfg.parallel
    if dims.ep == 1:
        return
    if not e:
        raise ConfigError("parallel.ep", "expert parallelism splits experts: set "
                          "model.moe_experts (a multiple of ep), or ep = 1")
    if e % dims.ep:
        raise ConfigError("parallel.ep", f"ep={dims.ep} must divide model.moe_experts={e}")
    why = None
    if dims.pp > 1 and par.pp_schedule == "zb1":
        why = ("parallel.pp_schedule", "zb1's weight pass would need the expert all-to-alls a "
               "second time; use 1f1b, gpipe or interleaved with ep > 1")
    if why:
        raise ConfigError(*why)


def _check_context(cfg: Config, dims: ParallelDims, shape: Shape) -> None:
    par, seq, C = cfg.parallel, cfg.data.seq_len, dims.cp
    if par.cp_method not in CP_METHODS:
        raise ConfigError("parallel.cp_method", f"one of {', '.join(CP_METHODS)}; got "
                          f"'{par.cp_method}'")
    if C == 1:
        return
    heads = shape.heads // dims.tp
    why = None
    if par.cp_method == "ring" and seq % (2 * C):
        why = ("data.seq_len", f"ring attention cuts each sequence into 2 x cp = {2 * C} equal "
               f"chunks (two per rank, for causal load balance): {seq} is not a multiple of "
               f"{2 * C}")
    elif par.cp_method == "ulysses" and seq % C:
        why = ("data.seq_len", f"Ulysses cuts each sequence into cp = {C} equal shards: {seq} is "
               f"not a multiple of {C}")
    elif par.cp_method == "ulysses" and heads % C:
        why = ("parallel.cp", f"Ulysses splits the {heads} attention heads of each tp rank "
               f"({shape.heads} heads / tp={dims.tp}) over cp={C}, which must divide them; "
               "use cp_method = 'ring'")
    elif shape.experts:
        why = ("parallel.cp", "context parallelism with a mixture of experts is not supported "
               "yet; set cp = 1 or model.moe_experts = 0")
    if why:
        raise ConfigError(*why)


def _check_model(cfg: Config) -> None:
    """plait's Llama: its sizes (its args' `problem`) and router; a Hugging Face folder's were
    checked by `check_hf`."""
    if cfg.model.hf:
        return
    args = cfg.model.args()
    problem = args.problem()
    if problem:
        raise ConfigError(f"model.{problem[0]}", problem[1])
    if args.moe_router not in ROUTERS:
        raise ConfigError("model.moe_router", f"one of {', '.join(ROUTERS)}; got "
                          f"'{args.moe_router}'")
