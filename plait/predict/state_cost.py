"""What a rank holds, from formulas: the model-state bytes after a step and at the step's peak,
and while it builds its part of a model (`cost.py`'s other half: the bytes it communicates).
The engines' accounting is asserted equal to these in the composition matrix; `plait train
--dry-run` and the planner use the same functions. Both halves read the data-parallel engine's
flat buffers as `flat_buffers` lays them out.
"""

from __future__ import annotations

import functools

import torch

from plait.comm.buckets import assign_buckets
from plait.comm.compression import Segment, build_compression, layout, members_numel
from plait.config.choices import HALF_PRECISIONS, held_precision
from plait.config.schema import Config, microbatches
from plait.mesh import ParallelDims
from plait.model.llama import BLOCK
from plait.parallel.engines.flat import optimizer_classes
from plait.parallel.engines.units import block_of
from plait.parallel.engines.zero import flat_groups
from plait.parallel.expert_parallel import expert_overrides
from plait.parallel.pipeline import stage_schedule
from plait.parallel.pipeline.schedules import Kind
from plait.parallel.placement import PlacementRecord


def _meta(record: PlacementRecord, dtype=torch.float32) -> list[tuple[str, torch.Tensor]]:
    """The held parameters an optimizer steps as shapes only, in the engines' order (the frozen
    ones are in no flat buffer)."""
    return [(n, torch.empty(p.local_shape, dtype=dtype, device="meta"))
            for n, p in record.params.items() if n not in record.frozen]


def frozen_bytes(record: PlacementRecord) -> tuple[int, int]:
    """(elements, bytes) of the frozen parameters this rank holds, whole."""
    return (sum(record.params[n].local_numel for n in record.frozen),
            sum(record.params[n].local_numel * size for n, size in record.frozen.items()))


def padded_numel(numel: int, k: int) -> int:
    return -(-numel // k) * k


def flat_buffers(cfg: Config, dims: ParallelDims, record: PlacementRecord):
    """The data-parallel engine's flat buffers (DDP's buckets, ZeRO's flat parameters), each as
    (the group it is reduced over, that group's size, the layout of its parameters, unpadded):
    dense parameters over the batch's ranks (dp x cp x ep, or under hybrid sharding a shard
    group's: its dp_shard ranks x cp x ep), experts over dp (hybrid: over dp_shard ranks)."""
    experts = ("dp", dims.dp)
    if dims.hybrid and cfg.parallel.zero:
        dense, experts = ("dp_shard", dims.shard_ranks), ("dp_shard_experts", dims.shard)
    else:
        dense = ("batch", dims.batch) if dims.batch > dims.dp else ("dp", dims.dp)
    masters = cfg.parallel.zero == 0 and half_params(cfg)
    return [(*(experts if expert else dense), segments) for expert, segments, _ in
            flat_layouts(record, cfg.parallel.zero, cfg.parallel.bucket_mb, matrices(cfg, record),
                         masters)]


def half_params(cfg: Config) -> bool:
    """Whether the parameters are held in a half dtype, with fp32 masters
    (`choices.held_precision`)."""
    return held_precision(cfg.train.precision, cfg.train.param_dtype,
                          cfg.parallel.zero) in HALF_PRECISIONS


def matrices(cfg: Config, record: PlacementRecord) -> frozenset[str]:
    """What the configured optimizer steps as whole matrices (Muon's), by name; else none."""
    return record.optimizer.matrices if cfg.train.optimizer == "muon" else frozenset()


@functools.lru_cache(maxsize=512)
def flat_layouts(record: PlacementRecord, zero: int, bucket_mb: float,
                 matrices: frozenset[str] = frozenset(), masters: bool = False
                 ) -> list[tuple[bool, list[Segment], int]]:
    """(experts?, layout, group) per flat buffer, in the engine's order (`sync_classes`: dense
    first; within each, the optimizer's classes, `optimizer_classes`, but for DDP's buckets of
    fp32 parameters, which mix them: `masters` says DDP's are half); the group is what is
    reduced at once: ZeRO-3's unit, else the buffer itself. Cached by the record's identity: a
    record is complete once `place` returns, and the planner prices many layouts on each."""
    named = _meta(record)
    experts = expert_overrides(record)
    groups = []
    if zero == 3:
        for u, unit in enumerate(set(z.names) for z in record.units):
            members = [(n, p) for n, p in named if n in unit]
            for cls in (False, True):
                groups += [(cls, m, u) for m, *_ in optimizer_classes(
                    [(n, p) for n, p in members if (n in experts) == cls], matrices,
                    record.optimizer.groups)]
    else:
        for cls in (False, True):
            members = [(n, p) for n, p in named if (n in experts) == cls]
            if not members:
                continue
            if zero == 0:
                classes = optimizer_classes(members, matrices, record.optimizer.groups) if masters \
                    else [(members,)]
                groups += [(cls, m, None) for members, *_ in classes for m in assign_buckets(
                    members, int(bucket_mb * 2**20), int(min(1.0, bucket_mb) * 2**20))]
            else:
                flats = flat_groups(members, bucket_mb, matrices, record.optimizer.groups)
                groups += [(cls, m, None) for m, *_ in flats]
    kept = [(cls, layout(members), u) for cls, members, u in groups if members]
    return [(cls, segments, i if u is None else u) for i, (cls, segments, u) in enumerate(kept)]


def compression_method(cfg: Config):
    """The configured method (for its formulas), or None."""
    par = cfg.parallel
    built = build_compression(par.compression, par.compression_ratio, par.compression_rank)
    return built.method if built is not None else None


def dtype_bytes(cfg: Config) -> tuple[int, int]:
    """(bytes per parameter element held, bytes per gradient element reduced): 2 for half
    parameters (`half_params`), else 4; ZeRO reduces in `parallel.reduce_dtype`, DDP in fp32."""
    reduce_half = cfg.parallel.zero > 0 and cfg.parallel.reduce_dtype != "fp32"
    return (2 if half_params(cfg) else 4), (2 if reduce_half else 4)


def state_bytes(cfg: Config, dims: ParallelDims, record: PlacementRecord) -> dict[str, int]:
    """Model-state bytes this rank holds after a step: parameters, gradients, optimizer state
    (AdamW: two fp32 moments; under half parameters also the fp32 master: ZeRO's 2 + 2 + 12 per
    parameter, DDP's 2 + 4 + 12: its gradient sums are fp32),
    ZeRO's shards padded to a multiple of the sharding group; with gradient compression, its
    state ("compression"); and "peak", the most held during the step (`_params_peak` +
    `_grads_peak` + the rest)."""
    par = cfg.parallel
    param_b, reduce_b = dtype_bytes(cfg)
    bf16 = param_b == 2
    frozen, frozen_b = frozen_bytes(record)
    held = record.held_numel() - frozen  # what an optimizer steps
    flats = [(s, K, padded_numel(members_numel(s), K if par.zero else 1))
             for _, K, s in flat_buffers(cfg, dims, record)]
    muon = matrices(cfg, record)
    if par.zero == 0:
        state = {"params": param_b * held + frozen_b, "grads": 4 * held,
                 "optimizer": sum((optimizer_bytes(cfg, n in muon) + 4 * bf16) * p.local_numel
                                  for n, p in record.params.items() if n not in record.frozen)}
    else:
        padded = sum(numel for _, _, numel in flats)
        sliced = sum(numel // K for _, K, numel in flats)
        state = {"params": param_b * (sliced if par.zero == 3 else padded) + frozen_b,
                 "grads": param_b * held if par.zero == 1 else reduce_b * sliced,
                 "optimizer": sum((optimizer_bytes(cfg, s[0].name in muon) + 4 * bf16)
                                  * (numel // K) for s, K, numel in flats)}
    method = compression_method(cfg)
    if method is not None:  # error feedback, PowerSGD's Q: fp32, once compression has run
        state["compression"] = 4 * sum(method.state_numel(s, n) for s, _, n in flats) \
            if dims.dp > 1 else 0
    rest = sum(v for k, v in state.items() if k not in ("params", "grads"))
    if par.zero == 0:
        state["peak"] = sum(state.values())  # replicas hold it all, all step long
    else:
        groups = [u for *_, u in flat_layouts(record, par.zero, par.bucket_mb)]
        schedule = stage_schedule(par, dims.pp, microbatches(par, dims), checked=False)
        kind = Kind.W if schedule.split_backward else Kind.B
        passes = [a.chunk for a in schedule.actions[record.coords["pp"]] if a.kind is kind]
        full = cfg.train.activation_checkpointing == "full"
        state["peak"] = rest + _params_peak(record, flats, groups, par, state["params"], param_b,
                                            full) \
            + _grads_peak(record, flats, groups, par.zero, passes, param_b, reduce_b)
    return state


def optimizer_bytes(cfg: Config, matrix: bool) -> int:
    """Optimizer state per element stepped, fp32: AdamW's two moments; Muon's (a matrix) or
    SGD's momentum; plain SGD none."""
    optimizer = cfg.train.optimizer
    if optimizer == "sgd":
        return 4 if cfg.train.sgd_momentum else 0
    return 4 if matrix and optimizer == "muon" else 8


def startup_bytes(cfg: Config, dims: ParallelDims, record: PlacementRecord) -> int:
    """An upper bound of the device bytes a rank holds while it builds its part of a model built
    on `meta` (`plait.model.materialize`); no activations or gradients exist yet, and what
    offload keeps in host memory is left out.

    ZeRO-3: its slices (and fp32 masters under bf16), plus, for the flat slice being made, its
    fp32 copy and the rows drawn for it: at most 16 bytes per element of the largest slice, and
    two draw blocks at its ends (no larger than the largest tensor). Otherwise: every tensor it
    holds, whole, in fp32 (drawn one at a time: at most 8 more bytes per element of the largest),
    then each bucket laid out (an fp32 and a parameter-dtype copy of the largest), and the
    masters of its slices."""

    par = cfg.parallel
    param_b, _ = dtype_bytes(cfg)
    bf16 = param_b == 2
    flats = [(K, padded_numel(members_numel(s), K if par.zero else 1))
             for _, K, s in flat_buffers(cfg, dims, record)]
    sliced = sum(n // K for K, n in flats)
    largest = max(p.local_numel for p in record.params.values())
    # Offload keeps the masters (and, "params", the slices) in host memory: not on the device.
    masters = 4 * sliced if bf16 and par.offload == "none" else 0
    blocks = 2 * 4 * min(BLOCK, largest)  # whole draw blocks at a slice's two ends
    if par.zero == 3:  # (and the frozen parameters, whole)
        slices = 0 if par.offload == "params" else param_b * sliced
        return slices + masters + 16 * max(n // K for K, n in flats) + blocks + \
            frozen_bytes(record)[1]
    return 4 * record.held_numel() + masters + blocks + max(
        8 * largest, (4 + param_b) * max(n for _, n in flats))


def _params_peak(record: PlacementRecord, flats, groups: list[int], par, params: int,
                 param_b: int, full: bool = False) -> int:
    """The most parameter bytes held during a step. ZeRO-1/2: the whole replica, always.
    ZeRO-3: the slices plus the units gathered at once: a unit and the next one (prefetched, in
    the forward; the previous one in the backward) in each chunk, unless the two would hold more
    than `parallel.max_live_params` elements with what else is gathered (then the unit alone),
    plus the chunk's first unit where it spans the chunk (tied embeddings, a wrap policy's
    leftover); every unit of the stage when they are kept from forward to backward
    (`reshard_after_forward = false`). Under full recomputation (`full`), units below a block
    (a wrap policy's) are gathered by the block's forward run again inside its last unit's
    backward, and kept for their own backward: all of the block's at once."""
    if par.zero < 3:
        return params
    numel = _unit_numel(record, flats, groups)
    if not par.reshard_after_forward:
        return params + param_b * sum(numel)
    bound = par.max_live_params or sum(numel)
    most = 0
    for chunk in sorted({z.chunk for z in record.units}):
        mine = [u for u, z in enumerate(record.units) if z.chunk == chunk]
        span = numel[mine[0]] if record.units[mine[0]].spans else 0
        rest = [numel[u] for u in mine if not (u == mine[0] and span)] or [0]
        pairs = [a + b if span + a + b <= bound else max(a, b)
                 for a, b in zip(rest, rest[1:], strict=False)]
        most = max(most, span + max(pairs + rest))
        if full:
            blocks: dict[str, int] = {}
            for u in mine:
                key = _block_of(record.units[u].names)
                if key is not None:
                    blocks[key] = blocks.get(key, 0) + numel[u]
            most = max(most, span + max(blocks.values(), default=0))
    return params + param_b * most


def _unit_numel(record: PlacementRecord, flats, groups: list[int]) -> list[int]:
    """The elements each ZeRO-3 unit gathers (its flat buffers, padded)."""
    numel = [0] * len(record.units)
    for (_, _, padded), unit in zip(flats, groups, strict=True):
        numel[unit] += padded
    return numel


def unprefetched_share(cfg: Config, dims: ParallelDims, record: PlacementRecord) -> float:
    """ZeRO-3: the share of a step's all-gathered elements that no prefetch starts before its
    unit runs, whose transfer nothing computes beside: per chunk, each pass's first unit (the
    forward's first, the backward's last, a spanning unit's both: nothing runs before them in
    the chunk to prefetch them) and each unit whose prefetch `parallel.max_live_params` holds
    back (`zero3.Zero3DataParallel._prefetch`). 0 below stage 3."""
    par = cfg.parallel
    if par.zero != 3 or not record.units:
        return 0.0
    flats = [(s, K, padded_numel(members_numel(s), K)) for _, K, s in
             flat_buffers(cfg, dims, record)]
    numel = _unit_numel(record, flats, [u for *_, u in flat_layouts(record, 3, par.bucket_mb)])
    passes = 2 if par.reshard_after_forward else 1  # kept whole: gathered once, forward
    exposed = 0
    for chunk in sorted({z.chunk for z in record.units}):
        mine = [u for u, z in enumerate(record.units) if z.chunk == chunk]
        span = numel[mine[0]] if record.units[mine[0]].spans else 0

        def held_back(now: int, unit: int) -> bool:
            return bool(par.max_live_params) and now + numel[unit] > par.max_live_params

        exposed += numel[mine[0]] + sum(numel[b] for a, b in zip(mine, mine[1:], strict=False)
                                        if held_back(span * (a != mine[0]) + numel[a], b))
        if passes == 2:
            rest = mine[1:] if span else mine
            exposed += span + numel[rest[-1]] if rest else span
            exposed += sum(numel[b] for a, b in zip(rest[::-1], rest[-2::-1], strict=False)
                           if held_back(span + numel[a], b))
    return exposed / (passes * sum(numel))


def _block_of(names) -> str | None:
    """The block a unit's parameters all belong to (`units.block_of`), or None (the unit of what
    a wrap policy leaves over, the embedding, the head)."""
    keys = {block_of(name) for name in names}
    return keys.pop() if len(keys) == 1 else None


def _grads_peak(record: PlacementRecord, flats, groups: list[int], zero: int,
                passes: list[int], param_b: int, reduce_b: int) -> int:
    """The most gradient bytes the ZeRO engines hold during a step. `passes`: the chunk of each
    pass of this stage's schedule that produces weight gradients (B, or W when the backward is
    split), in order. A chunk's passes before its last accumulate into the parameters' own
    `.grad`; its last pass delivers them to the engine in arrival order (the reverse of the
    parameters' order): each `.grad` is copied into the full-size staging of its bucket (ZeRO-3:
    of all its unit's flats) and, in stage 2 and 3, let go; a bucket (in order) or a unit, once
    all its gradients arrived, is reduce-scattered into its averaged slice, after the group
    launched before it is settled and its staging let go. Counted: the `.grad`s, the staging
    alive, the slices."""
    numel = {n: p.local_numel for n, p in record.params.items()}
    flat_of = {seg.name: i for i, (segments, _, _) in enumerate(flats) for seg in segments}
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    left = [len(segments) for segments, _, _ in flats]
    staged, inflight, slices, next_bucket, most = set(), [], 0, 0, 0
    held, own = set(), 0

    def alive() -> int:
        return own + reduce_b * sum(flats[i][2] for i in staged) + slices

    def launch(group: list[int]) -> None:
        nonlocal inflight, slices, most
        staged.difference_update(inflight)  # settled: the staging let go
        inflight = group
        slices += reduce_b * sum(flats[i][2] // flats[i][1] for i in group)
        most = max(most, alive())

    final = {c: k for k, c in enumerate(passes)}  # the last pass of each chunk
    by_chunk = {}
    for n in record.params:
        if n not in record.frozen:  # no gradient
            by_chunk.setdefault(record.chunk_of[n], []).append(n)
    for k, chunk in enumerate(passes):
        names = by_chunk.get(chunk, [])
        if k != final[chunk]:  # gradients accumulate in the parameters
            own += param_b * sum(numel[n] for n in names if n not in held)
            held.update(names)
            continue
        for name in reversed(names):
            i = flat_of[name]
            staged.update(members[groups[i]] if zero == 3 else [i])
            if name not in held:
                own += param_b * numel[name]
                held.add(name)
            most = max(most, alive())
            if zero >= 2:
                own -= param_b * numel[name]
                held.discard(name)
            left[i] -= 1
            if zero == 3 and all(left[j] == 0 for j in members[groups[i]]):
                launch(members[groups[i]])
            while zero < 3 and next_bucket < len(flats) and left[next_bucket] == 0:
                launch([next_bucket])
                next_bucket += 1
    return most
