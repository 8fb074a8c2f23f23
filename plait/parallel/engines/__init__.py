"""The data-parallel engines and the one they build for a layout (`parallel.zero` names it: DDP
ddp.py | ZeRO-1/2 zero.py | ZeRO-3 zero3.py, its units cut by units.py), over this stage's
chunks: the last step of `parallelize`'s straight line. They share one interface
(replicas.py), one flat-parameter type (flat.py), the model-state accounting (state.py) and
ZeRO's host staging (buffer_pool.py)."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.device_mesh import DeviceMesh

from plait.comm.allreduce import AllReduceAlgorithm, NodeGroups
from plait.comm.compression import build_compression
from plait.config.schema import ParallelConfig
from plait.mesh import (
    AXES,
    Axis,
    ParallelDims,
    dp_per_node,
    hsdp_groups,
    ranks_per_node,
)
from plait.model.materialize import Filler
from plait.optim.loss_scaling import HALF
from plait.parallel.engines.ddp import BucketedDataParallel
from plait.parallel.engines.replicas import SyncedReplicas
from plait.parallel.engines.zero import ZeroDataParallel
from plait.parallel.engines.zero3 import Zero3DataParallel
from plait.parallel.expert_parallel import expert_overrides
from plait.parallel.pipeline import StageModules
from plait.parallel.placement import PlacementRecord
from plait.parallel.wrap import WrapPolicy


def build_data_parallel(chunks: StageModules, mesh: DeviceMesh, cfg: ParallelConfig,
                        held: torch.dtype | None, axes: dict[str, Axis], record: PlacementRecord,
                        wrap: WrapPolicy | None = None, fill: Filler | None = None,
                        matrices: frozenset[str] = frozenset()) -> SyncedReplicas:
    """`_engine`, with `parallel.unused_parameters` set on it (`SyncedReplicas.zero_unused`)."""
    engine = _engine(chunks, mesh, cfg, held, axes, record, wrap, fill, matrices)
    engine.zero_unused = cfg.unused_parameters
    return engine


def _engine(chunks: StageModules, mesh: DeviceMesh, cfg: ParallelConfig,
                        held: torch.dtype | None, axes: dict[str, Axis], record: PlacementRecord,
                        wrap: WrapPolicy | None = None, fill: Filler | None = None,
                        matrices: frozenset[str] = frozenset()) -> SyncedReplicas:
    """The engine `parallel.zero` names, over the ranks that split the batch (dp x cp x ep; or,
    hybrid, over groups of `parallel.dp_shard` dp ranks with their cp and ep ranks, replicated
    across the groups), the experts over dp (hybrid: over their `dp_shard` dp ranks), reducing
    gradients with the `parallel.compression` method. With a `held`
    dtype (half) the parameters are held in it, with fp32 masters; ZeRO reduces gradients in it
    where `parallel.reduce_dtype` names it, DDP in fp32."""
    dp = axes["batch"]
    overrides = {n: axes["dp"] for n in expert_overrides(record)}
    compression = build_compression(cfg.compression, cfg.compression_ratio,
                                    cfg.compression_rank, cfg.compression_start)
    classes = {"matrices": matrices, "groups": record.optimizer.groups}
    if cfg.zero == 0:
        nodes = None
        if cfg.allreduce == "hierarchical":
            # Each reduction group seen as nodes: the batch's (a node's dp x cp x ep ranks) and,
            # under ep, the experts' (a node's dp ranks of one ep rank); the same groups across.
            dims = ParallelDims(**{a: mesh[a].size() for a in AXES})
            node = dp_per_node(dims, ranks_per_node(cfg.ranks_per_node, dims.world_size))
            local, across, experts = hsdp_groups(dataclasses.replace(dims, dp_shard=node))
            nodes = {dp.group: NodeGroups(local.group, across.group)}
            if experts is not None:
                nodes[axes["dp"].group] = NodeGroups(experts.group, across.group)
        return BucketedDataParallel(chunks, dp.group, bucket_mb=cfg.bucket_mb,
                            algorithm=AllReduceAlgorithm(cfg.allreduce), compression=compression,
                            overrides={n: a.group for n, a in overrides.items()}, nodes=nodes,
                            param_dtype=held, **classes)
    shard, replicate, experts = dp, None, axes["dp"]
    dims = ParallelDims(**{a: mesh[a].size() for a in AXES}, dp_shard=cfg.dp_shard)
    if dims.hybrid:  # groups of dp_shard dp ranks with their cp and ep ranks, replicated across
        shard, replicate, by_experts = hsdp_groups(dims)
        experts = by_experts or experts
        overrides = {n: experts for n in overrides}
    precision = {
        "param_dtype": held,
        "reduce_dtype": HALF[cfg.reduce_dtype] if cfg.reduce_dtype != "fp32" else torch.float32,
    }
    if cfg.zero == 3:
        engine = Zero3DataParallel(chunks, shard, **precision, offload=cfg.offload,
                                   replicate=replicate,
                                   reshard_after_forward=cfg.reshard_after_forward,
                                   compression=compression, overrides=overrides,
                                   wrap=wrap, max_live=cfg.max_live_params, fill=fill,
                                   **classes)
    else:
        engine = ZeroDataParallel(chunks, shard, cfg.zero, cfg.bucket_mb, **precision,
                                  offload_optimizer=cfg.offload == "optimizer",
                                  replicate=replicate, compression=compression,
                                  overrides=overrides, **classes)
    engine.expert_axis = experts
    return engine
