"""`plait.estimate`: what each rank of a layout would hold, keep, compute and move for a model a
user brings from Python, before any process starts.

    import plait
    ranks = plait.estimate(model, example_batch, plait.ParallelConfig(zero=3), world_size=8,
                           wrap=plait.WrapPolicy(classes=(Block,)), gpu="h100")
    ranks[0]["activation_bytes"], ranks[0]["state"]["peak"], ranks[0]["step_time_s"]

The batch is one global batch as `job.step(batch, optimizer)` takes it (a tensor, tuple or dict;
only its shapes and dtypes are read). Each rank's step is traced on fake tensors (`trace.py`):
the same `parallelize` and step as `plait.prepare` and `job.step` run, so its activation bytes,
FLOPs and collectives are the run's. Model-state bytes are the engines' formulas
(`predict/state_cost.py`), which the composition matrix asserts equal to real runs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from plait.config.checks_layout import validate_parallel
from plait.config.schema import Config, ParallelConfig
from plait.mesh import build_mesh, rows_share
from plait.model.plan import check_plan, has_plan
from plait.parallel import Options, parallelize
from plait.parallel.batch import as_microbatches
from plait.parallel.wrap import WrapPolicy
from plait.planner.gemm import PEAK_SHARE
from plait.planner.hardware import DEVICES, Cluster
from plait.planner.price import stage_seconds
from plait.planner.search import data_parallel_choices, hybrid_needs_zero, ranked
from plait.predict import cost
from plait.predict.trace import fake_module, fake_world, representative, trace_step


def estimate(model: nn.Module, example_batch, parallel: ParallelConfig | None = None, *,
             world_size: int = 1, loss_fn: Callable | None = None,
             wrap: WrapPolicy | None = None, checkpoint: WrapPolicy | None = None,
             precision: str = "fp32", gpu: str | None = None,
             gpus_per_node: int = 8) -> list[dict]:
    """Per rank of `parallel` on `world_size` ranks (arguments as `plait.prepare` takes them):
    `coords`, `state` (model-state bytes after a step, and "peak" during it), `startup_bytes`
    (while it builds its part), `activation_bytes` (the peak kept for backward), `flops` (what
    it executes in a step), `comm_calls` and `comm_bytes` (its collectives by operation, bus
    bytes); given `gpu` (a `plait plan --gpu` name), `step_time_s` on such devices, for a model
    with no plan (its layouts are data-parallel; a plan's model shape is not read here).
    Nothing of `model` is copied or changed: the trace runs on fake tensors."""
    parallel = parallel or ParallelConfig()
    if next(model.parameters(), None) is None:
        raise ValueError(f"model: {type(model).__name__} has no parameters; nothing to train")
    dims = validate_parallel(parallel, world_size, precision)
    check_plan(model, dims.tp)
    cfg = Config(parallel=parallel)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
    device = next(model.parameters()).device
    device = torch.device("cpu") if device.type == "meta" else device
    M = parallel.microbatches or dims.pp
    options = Options(microbatches=M, precision=precision,
                      activation_checkpointing="full" if checkpoint else "none", loss_fn=loss_fn,
                      wrap=wrap or WrapPolicy(), checkpoint=checkpoint or WrapPolicy())
    classes: dict[int, dict] = {}
    out = []
    for rank in range(dims.world_size):
        stands = representative(dims, rank)  # the rank that runs the same shapes
        if stands not in classes:
            classes[stands] = _trace_module(model, example_batch, parallel, dims, stands,
                                            options, device, cfg)
        out.append({"rank": rank, "coords": dims.coords(rank), **classes[stands]})
    if gpu is not None:
        _add_step_time(out, cfg, dims, model, gpu, gpus_per_node)
    return [{k: v for k, v in r.items() if k != "_record"} for r in out]


def _trace_module(model, batch, parallel, dims, rank, options, device, cfg) -> dict:
    with fake_world(rank, dims.world_size):
        mesh = build_mesh(dims, device.type)
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            parallelized = parallelize(fake_module(model, device, mode), mesh, parallel, options)
            fake_batch = tree_map(
                lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)
            here, rows = rows_share(parallelized.axes)
            microbatches = as_microbatches(fake_batch, here, rows, options.microbatches,
                                           options.loss_fn is None)
            traced = trace_step(parallelized, microbatches)
        record = parallelized.record
        return {"state": cost.state_bytes(cfg, dims, record),
                "startup_bytes": cost.startup_bytes(cfg, dims, record),
                "activation_bytes": traced.activation_bytes, "flops": traced.flops,
                "comm_calls": {op.value: n for op, n in traced.calls.items()},
                "comm_bytes": float(traced.comm_bytes), "_record": record}


def _add_step_time(ranks: list[dict], cfg: Config, dims, model: nn.Module, gpu: str,
                   gpus_per_node: int) -> None:
    """Each rank's step on `gpu` by the planner's time model (`plait.planner.stage_seconds`):
    its traced FLOPs at the device's achieved peak for large matmuls (`planner.gemm`; a module
    without a plan has no shapes the planner knows)."""

    if has_plan(model):
        raise ValueError("gpu: the step time of a model with a plan is `plait plan`'s (its "
                         "layouts price the plan's shapes); estimate without gpu= for its bytes")
    if gpu not in DEVICES:
        raise ValueError(f"gpu: one of {', '.join(sorted(DEVICES))}, not {gpu!r}")
    cluster = Cluster(dims.world_size, gpus_per_node, DEVICES[gpu])
    for r in ranks:
        traffic = cost.step_traffic(cfg, dims, r["_record"], [cost.ChunkLayout(0, 0, True, True)])
        compute = r["flops"] / (cluster.device.peak_flops * PEAK_SHARE["bf16"])
        r["step_time_s"], r["comm_s"] = stage_seconds(
            compute, traffic, cfg.parallel.zero, dims, cluster,
            unprefetched=cost.unprefetched_share(cfg, dims, r["_record"]))


def plan(model: nn.Module, example_batch, gpus: int, gpu: str, *,
         loss_fn: Callable | None = None, wrap: WrapPolicy | None = None,
         checkpoint: WrapPolicy | None = None, precision: str = "fp32",
         gpus_per_node: int = 8) -> list[dict]:
    """`plait plan` for a module from Python (`plait.plan`): the data-parallel layouts that
    `plait plan`'s search tries on a mesh of `gpus` replicas (`search.data_parallel_choices`:
    ZeRO 0-3, micro-batches of 1, 2, 4, 8 and of one row where each rank's rows split so, hybrid
    sharding within a node where the replicas span nodes), each `estimate`d on devices of kind
    `gpu`, ranked as `plait plan` ranks (`search.ranked`: those that fit the device first, then
    the fastest, the lower ZeRO stage, the leaner; first, the lowest stage within 2% of the
    fastest). Each row: `parallel` (a `ParallelConfig`
    to hand to `plait.prepare`), `fits`, `memory_bytes` (the fullest rank's model state at its
    peak plus its activations), `step_time_s` and `comm_bytes` (the slowest and busiest
    rank's). A model with a plan also splits by tp, pp, cp and ep: that is `plait plan`'s
    search of every mesh."""

    if has_plan(model):
        raise ValueError("model: it has a plan, whose layouts (tp, pp, cp, ep) `plait plan "
                         "model.hf=... --gpus N` searches; plait.plan, a module "
                         "without one")
    if gpu not in DEVICES:
        raise ValueError(f"gpu: one of {', '.join(sorted(DEVICES))}, not {gpu!r}")
    for name, value in (("gpus", gpus), ("gpus_per_node", gpus_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: a whole number of devices, at least 1; got {value!r}")
    rows = _rows(example_batch) // gpus
    if rows < 1:
        raise ValueError(f"example_batch: {_rows(example_batch)} rows cannot split over "
                         f"{gpus} gpus; give at least one row per gpu")
    choice = data_parallel_choices(rows, gpus, 1, 1, gpus_per_node)
    candidates = [ParallelConfig(zero=zero, microbatches=m, dp_shard=shard)
                  for zero, m, shard in itertools.product(*choice.values())
                  if rows % m == 0 and hybrid_needs_zero(zero, shard)
                  and (not shard or gpus % shard == 0)]
    memory = DEVICES[gpu].memory_bytes
    out = []
    for parallel in candidates:
        ranks = estimate(model, example_batch, parallel, world_size=gpus, loss_fn=loss_fn,
                         wrap=wrap, checkpoint=checkpoint, precision=precision, gpu=gpu,
                         gpus_per_node=gpus_per_node)
        held = max(r["state"]["peak"] + r["activation_bytes"] for r in ranks)
        out.append({"parallel": parallel, "fits": held <= memory, "memory_bytes": held,
                    "step_time_s": max(r["step_time_s"] for r in ranks),
                    "comm_bytes": max(r["comm_bytes"] for r in ranks)})
    return ranked(out, lambda r: (r["fits"], r["step_time_s"], r["parallel"].zero,
                                  r["memory_bytes"]))


def _rows(batch) -> int:
    """The rows of a global batch (its first tensor's first dimension)."""
    leaves = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    if not leaves:
        raise ValueError("example_batch: no tensor in it")
    return leaves[0].shape[0]


__all__ = ["estimate", "plan"]
