"""The planner's search: which layouts to price (`meshes`, `candidates`), their ranking, and
what `plait plan` says of each (`warnings`) and of the best (`reasons`). Pricing one layout is
`plait.planner.price.estimate`."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from plait.config.checks_layout import check_layout
from plait.config.schema import Config, ConfigError
from plait.mesh import ParallelDims
from plait.planner.hardware import Cluster
from plait.planner.price import (
    HEADROOM,
    PricedLayout,
    estimate,
    layout_degrees,
    traced_stage,
    with_degrees,
)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


LONG_SEQUENCE = 16384  # tokens from which context parallelism is searched
MIN_CP_CHUNK = 1024  # tokens a ring chunk keeps at least (2 cp chunks per sequence)


def meshes(cfg: Config, cluster: Cluster, fixed: dict):
    """(tp, pp, cp, ep) layouts to search: tp within a node (across nodes only when pinned: its
    all-reduces in every layer would cross the slow links), pp up to one layer per stage, cp for
    long sequences, ep for mixtures of experts; the rest of the GPUs are dp."""
    N, G, shape = cluster.gpus, cluster.gpus_per_node, cfg.model.shape()
    seq = cfg.data.seq_len
    for tp in [fixed["tp"]] if "tp" in fixed else _divisors(math.gcd(N, G)):
        for pp in [fixed["pp"]] if "pp" in fixed else _divisors(N // tp):
            if N % (tp * pp) or pp > shape.layers:
                continue
            rest = N // (tp * pp)
            cps = [fixed["cp"]] if "cp" in fixed else [
                c for c in _divisors(rest) if c == 1 or seq >= LONG_SEQUENCE
                and seq // (2 * c) >= MIN_CP_CHUNK]
            for cp in cps:
                eps = [fixed["ep"]] if "ep" in fixed else [
                    e for e in _divisors(rest // cp) if shape.experts % e == 0]
                for ep in eps:
                    if rest % (cp * ep) == 0 and fixed.get("dp", rest // (cp * ep)) == \
                            rest // (cp * ep):
                        yield tp, pp, cp, ep, rest // (cp * ep)


def data_parallel_choices(rows: int, dp: int, pp: int, tp: int, gpus_per_node: int,
                          cp: int = 1, ep: int = 1) -> dict:
    """The data-parallel part of the layouts tried on a mesh of `dp` replicas of `rows` rows
    each: every ZeRO stage, micro-batches of 1, 2, 4 and 8 per stage and of one row, and hybrid
    sharding within a node where dp spans nodes (with a ZeRO stage: `hybrid_needs_zero`; a
    shard group is its dp ranks' tp x cp x ep ranks, so a node holds G / (tp x cp x ep) of its
    dp ranks). `plait plan` tries them on every mesh, `plait.plan` (a module from Python) on its
    one."""
    inner = tp * cp * ep
    G, K = gpus_per_node, gpus_per_node // inner
    hybrid = G % inner == 0 and (K > 1 or cp * ep > 1) and 0 < K < dp
    return {"zero": [0, 1, 2, 3],
            "microbatches": sorted({pp * k for k in (1, 2, 4, 8)} | {rows}),
            "dp_shard": [0] + ([K] if hybrid else [])}


MAX_VIRTUAL = 8  # virtual stages searched at most (Megatron's runs: 2 to 8; 405B's: 7 of 126)


def virtual_stages(layers: int, pp: int) -> list[int]:
    """The virtual stages per pipeline rank (`pp_virtual`) the interleaved schedule is tried
    with: 2, and each count up to MAX_VIRTUAL that cuts the layers into equal chunks (more
    chunks divide the bubble by more, for one more round of sends each)."""
    return [2] + [v for v in range(3, MAX_VIRTUAL + 1) if layers % (pp * v) == 0]


def hybrid_needs_zero(zero: int, dp_shard: int) -> bool:
    """Whether a layout's hybrid sharding (`dp_shard`) has the ZeRO stage it shards by."""
    return not dp_shard or zero > 0


def order(fits: bool, step_time_s: float, zero: int, memory_bytes: float) -> tuple:
    """How plans rank, in `plait plan` and `plait.plan` alike: those that fit first, then the
    fastest, then the lower ZeRO stage, then the leaner."""
    return not fits, step_time_s, zero, memory_bytes


def candidates(cfg: Config, cluster: Cluster, fixed: dict):
    """Every layout check_layout accepts on cluster.gpus ranks; `fixed` pins degrees. Left out
    unless pinned, as dominated: GPipe (1F1B's bubble with more activations in flight) and tp
    without sequence parallelism (the same bytes, more activations). Activation checkpointing
    varies last, from none to full, so `rank_plans` can stop at the first mode that fits."""
    for c, dims in _tried(cfg, cluster, fixed):
        if not isinstance(dims, ConfigError):
            yield c, dims


def refusals(cfg: Config, cluster: Cluster, fixed: dict) -> Counter:
    """Why check_layout refused the layouts `candidates` tried: each reason, how many times."""
    return Counter(str(d) for _, d in _tried(cfg, cluster, fixed) if isinstance(d, ConfigError))


def _tried(cfg: Config, cluster: Cluster, fixed: dict):
    """Every layout `candidates` tries, with its dims or the ConfigError that refused it. Pinned
    virtual stages (`pp_virtual` > 1) are the interleaved schedule's: the others ignore them."""
    schedules = ["interleaved"] if fixed.get("pp_virtual", 1) > 1 else [
        "1f1b", "interleaved", "zb1"]
    layers = cfg.model.shape().layers
    for tp, pp, cp, ep, dp in meshes(cfg, cluster, fixed):
        rows = cfg.train.global_batch // (dp * ep) or 1
        choice = {
            "tp": [tp], "pp": [pp], "cp": [cp], "ep": [ep],
            "cp_method": ["ring", "ulysses"] if cp > 1 else ["ring"],
            "pp_schedule": schedules if pp > 1 else ["1f1b"],
            "pp_virtual": virtual_stages(layers, pp) if pp > 1 else [cfg.parallel.pp_virtual],
            "sequence_parallel": [tp > 1 and cluster.engine.sequence_parallel],
            **data_parallel_choices(rows, dp, pp, tp, cluster.gpus_per_node, cp, ep),
            "offload": ["none"],  # `rank_plans` searches it where nothing fits without
            "activation_checkpointing": ["none", "selective", "full"],
        }
        choice.update({k: [v] for k, v in fixed.items() if k != "dp"})  # dp: the mesh's
        keys = list(choice)
        for values in itertools.product(*(choice[k] for k in keys)):
            d = dict(zip(keys, values, strict=True))
            interleaved = d["pp_schedule"] == "interleaved"
            if not hybrid_needs_zero(d["zero"], d["dp_shard"]) or \
                    not interleaved and d["pp_virtual"] != choice["pp_virtual"][0]:
                continue  # (virtual stages are the interleaved schedule's alone)
            c = with_degrees(cfg, **d, dp=0)
            try:
                yield c, check_layout(c, cluster.gpus)
            except ConfigError as e:
                yield c, e


def rank_plans(cfg: Config, cluster: Cluster, fixed: dict) -> list[PricedLayout]:
    """Every valid layout priced, the ones that fit first, fastest first; warnings attached.
    Of the checkpointing modes of one layout only the first that fits is kept (recomputation
    only costs time). On a GPU, offload is searched when no layout fits without it (ZeRO-Offload
    for a model too big for its devices, not for speed)."""
    if "offload" not in fixed and not cluster.device.name.startswith("cpu"):
        # Offload only where nothing fits without it: it costs host copies and a CPU update.
        plans = rank_plans(cfg, cluster, {**fixed, "offload": "none"})
        if not any(p.fits for p in plans):
            plans = sorted(plans + rank_plans(cfg, cluster, {**fixed, "offload": "optimizer"})
                           + rank_plans(cfg, cluster, {**fixed, "offload": "params"}),
                           key=lambda p: order(*_terms(p)))
        return plans
    plans, fitted = [], set()
    for c, dims in candidates(cfg, cluster, fixed):
        layout = tuple(v for k, v in layout_degrees(c, dims).items()
                       if k != "activation_checkpointing")
        if layout in fitted:
            continue
        plan = estimate(c, dims, cluster)
        if plan.fits:
            fitted.add(layout)
        plan.warnings = warnings(plan, c, dims, cluster)
        plans.append(plan)
    return ranked(plans, _terms)


# A faster plan within this share of the fastest's throughput is not worth a higher ZeRO stage:
# the time model does not price every cost of more collectives (each launch, and its copies).
NEAR = 0.02


def _terms(p: PricedLayout) -> tuple[bool, float, int, float]:
    return p.fits, p.step_time_s, p.degrees["zero"], p.peak_memory_bytes


def ranked(plans: list, terms: Callable[[Any], tuple[bool, float, int, float]]) -> list:
    """`plans` as `plait plan` and `plait.plan` list them: in `order` of their `terms` (fits,
    step time, ZeRO stage, memory), with, first, the lowest ZeRO stage (then the leanest) of
    those that fit within NEAR of the fastest's throughput."""
    plans = sorted(plans, key=lambda p: order(*terms(p)))
    if not plans or not terms(plans[0])[0]:
        return plans
    slowest = terms(plans[0])[1] / (1 - NEAR)
    near = [p for p in plans if terms(p)[0] and terms(p)[1] <= slowest]
    first = min(near, key=lambda p: terms(p)[2:])
    return [first, *(p for p in plans if p is not first)]


def warnings(p: PricedLayout, cfg: Config, dims: ParallelDims, cluster: Cluster) -> list[str]:
    """The anti-patterns of the field, as they apply to plan p (of cfg on dims)."""
    d, out, dev = p.degrees, [], cluster.device
    if cfg.model.hf and traced_stage(cfg, dims, 0) is None:
        out.append(f"{cfg.model.hf}: its step reads values a fake tensor does not hold (a "
                   "router's), so its activations and FLOPs are priced as plait's Llama block "
                   "of the same shape, routed evenly")
    if cfg.train.precision == "bf16" and not dev.bf16:
        out.append(f"{dev.name} has no bf16 tensor cores: bf16 runs far below the "
                   f"{dev.peak_flops / 1e12:g} TFLOP/s priced here; use train.precision='fp16' "
                   "(loss scaling)")
    if not cluster.within_node(1, d["tp"]):
        out.append(f"tensor parallelism across nodes: tp={d['tp']} > {cluster.gpus_per_node} GPUs "
                   "per node, so its all-reduces in every layer cross the inter-node links; keep "
                   "tp within a node")
    elif d["tp"] > 1 and dev.intra_gbps < 100:
        out.append(f"tensor parallelism over slow links ({dev.intra_gbps:g} GB/s): its "
                   "all-reduces in every layer dominate; prefer ZeRO or pipeline stages")
    # Samples per data-parallel rank (the ranks that split the rows: dp x ep), not per GPU: the
    # tp, pp and cp ranks of a replica share its samples by design (a Megatron layout of 64
    # GPUs per replica runs 16-32 sequences per replica).
    rows = cfg.train.global_batch // (d["dp"] * d["ep"])
    if d["pp"] > 1 and rows < d["pp"]:
        out.append(f"{rows} samples per data-parallel rank for {d['pp']} pipeline stages: fewer "
                   "micro-batches than stages whatever parallel.microbatches says, so most "
                   "stages idle most of the step; raise train.global_batch or use fewer stages")
    # The schedule's own bubble (interleaving divides 1F1B's (p-1)/m by the virtual stages),
    # as idle time per unit of compute: b / (1 - b) of a bubble b of the step.
    idle = p.bubble / (1 - p.bubble) if p.bubble < 1 else float("inf")
    if d["pp"] > 1 and idle > 0.5:
        out.append(f"pipeline bubble {p.bubble:.0%} of the step: {d['pp']} stages, "
                   f"{d['pp_schedule']}, {d['microbatches']} micro-batches idle {idle:.0%} of "
                   "the compute; use at least 4 x pp micro-batches, an interleaved schedule or "
                   "fewer stages")
    if d["pp"] == 1 and d["microbatches"] > 1:
        # Said only where one micro-batch is the better plan: it fits, and it is not slower
        # (where it is slower, the accumulation is what the time model chose, not an
        # anti-pattern, and a plan must not carry a warning against itself).
        one = estimate(with_degrees(cfg, microbatches=1), dims, cluster)
        if one.fits and one.step_time_s <= p.step_time_s:
            out.append(f"gradient accumulation ({d['microbatches']} micro-batches) although the "
                       f"batch fits in one: it only adds passes ({one.step_time_s:.3g} s a "
                       f"step in one against {p.step_time_s:.3g} s)")
    threads = cfg.train.threads
    if d["offload"] != "none" and dev.host_thread_gbps * threads < dev.host_gbps / cluster.per_node:
        out.append(f"offload's CPU update runs on train.threads={threads} thread(s) per rank "
                   f"({dev.host_thread_gbps * threads:g} GB/s of the host's "
                   f"{dev.host_gbps / cluster.per_node:g} per GPU): give each rank its share of "
                   "the node's cores")
    if not p.fits:
        out.append(f"does not fit: {p.peak_memory_bytes / 1e9:.1f} GB per GPU of "
                   f"{dev.memory_bytes / 1e9:.0f} GB ({HEADROOM:.0%} usable)"
                   + (f", or {p.host_memory_bytes / 1e9:.0f} GB of host memory per node of "
                      f"{dev.host_memory_bytes / 1e9:.0f}" if d["offload"] != "none" else ""))
    return out


def reasons(p: PricedLayout, cluster: Cluster) -> list[str]:
    """Why plan p, in the field's words."""
    d = p.degrees
    out = [f"{'fits in' if p.fits else 'needs'} {p.peak_memory_bytes / 1e9:.1f} of "
           f"{cluster.device.memory_bytes / 1e9:.0f} GB per GPU with "
           + (f"ZeRO-{d['zero']}" if d["zero"] else "plain data parallelism")
           + (f", activation checkpointing {d['activation_checkpointing']}"
              if d["activation_checkpointing"] != "none" else "")]
    if d["offload"] != "none":
        what = "optimizer state" if d["offload"] == "optimizer" else \
            "optimizer state and parameter slices"
        out.append(f"{what} offloaded to host memory ({p.host_memory_bytes / 1e9:.0f} GB per "
                   "node; the update runs on the CPU)")
    if d["tp"] > 1:
        where = "within a node" if cluster.within_node(1, d["tp"]) else "across nodes"
        out.append(f"tensor parallelism {d['tp']} {where}"
                   + (" with sequence parallelism" if d["sequence_parallel"] else "")
                   + ", its collectives on the critical path (plait does not overlap them with "
                   "the matmuls, as Megatron-LM's and torchtitan's async TP do)")
    if d["pp"] > 1:
        out.append(f"{d['pp']} pipeline stages, {d['pp_schedule']}, {d['microbatches']} "
                   f"micro-batches: bubble {p.bubble:.0%}")
    if d["cp"] > 1:
        out.append(f"context parallelism {d['cp']}: each GPU holds 1/{d['cp']} of every sequence "
                   "and its activations")
    if d["ep"] > 1:
        out.append(f"expert parallelism {d['ep']}: each GPU holds 1/{d['ep']} of the experts, "
                   "tokens reach them by all-to-all")
    if d["dp"] > 1:
        hybrid = 0 < d["dp_shard"] < d["dp"]  # dp_shard = dp shards over all of dp
        out.append(f"data parallelism {d['dp']}" + (
            f" (hybrid: shards of {d['dp_shard']} dp ranks"
            + (" with their cp and ep ranks" if d["cp"] * d["ep"] > 1 else "") + ")"
            if hybrid else ""))
    if p.comm_s:
        out.append(f"communication not hidden: {p.comm_s:.3g} s of the {p.step_time_s:.3g} s "
                   "step")
    if p.compile_s:
        out.append(f"blocks compiled (train.compile): ~{p.compile_s:.0f} s before the first step")
    return out
