"""What one training step costs a rank, from formulas: the bytes and calls of every collective it
issues, and the model-state bytes it holds. The engine's ledger and state accounting are asserted
equal to these in the composition matrix; `plait train --dry-run` prints them without starting a
process, and the planner uses the same functions.

Bytes per collective follow the ring convention of `plait.comm.collectives` (all-reduce
2(n-1)/n D; all-gather and reduce-scatter (n-1)/n D of the full tensor; send D). Inputs are the
configuration, this rank's placement record (what it holds, with local shapes, in the engines'
order) and the layout of its pipeline chunks. Per micro-batch of r rows and sequence s, with T =
tp, an activation is A = r s dim elements:

- tensor parallelism, per block: forward g (all-reduce of the row-parallel outputs) x 2, backward
  f (all-reduce of the input gradients) x 2; under sequence parallelism all-gathers and
  reduce-scatters of the same tensors instead, plus an all-reduce of each norm gain's gradient.
  The embedding adds one forward reduction, the head one backward reduction, the vocabulary-
  parallel loss three all-reduces of one float per token. Full activation checkpointing repeats
  the blocks' forward collectives in the backward.
- pipeline: each chunk boundary sends an activation forward and a gradient back (A / T under
  sequence parallelism).
- data parallelism: DDP all-reduces every gradient once; ZeRO-1/2 reduce-scatter the gradients and
  all-gather the parameters (per flat bucket, padded to a multiple of the sharding group); ZeRO-3
  all-gathers each unit before every forward and backward (2M per step, or once with
  reshard_after_forward = false) and reduce-scatters it once; hybrid sharding all-reduces each
  gradient slice across the replicas. A compression method replaces each buffer's all-reduce or
  reduce-scatter with its own messages (`Method.messages`, in `plait.comm.compression`).
- the global gradient norm, every step: one float64 all-reduce per axis whose ranks hold
  different pieces.

Dtypes: the residual stream and its gradients are bf16 only with bf16 parameters (ZeRO + bf16);
matmul outputs are bf16 under any bf16 training (autocast).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from plait.comm import Op, bus_bytes
from plait.comm.buckets import assign_buckets
from plait.comm.compression import Segment, build_compression, layout, members_numel
from plait.config import Config, microbatches
from plait.mesh import ParallelDims
from plait.model.plan import has_plan, plan_of
from plait.parallel.expert_parallel import expert_overrides, moe_layers
from plait.parallel.pipeline import stage_schedule
from plait.parallel.pipeline.schedules import Kind
from plait.parallel.placement import PlacementRecord
from plait.parallel.zero import flat_groups


@dataclass(frozen=True)
class ChunkLayout:
    index: int
    layers: int
    first: bool  # holds the embedding
    last: bool  # holds the head
    moe: int = 0  # mixture-of-experts blocks


def chunk_layouts(chunks) -> list[ChunkLayout]:
    """This stage's chunks (a StageModules) as the formulas need them."""
    out = []
    for c, m in chunks.items():
        if has_plan(m):
            blocks = len(m.get_submodule(plan_of(m).blocks))
            out.append(ChunkLayout(int(c), blocks, m.first, m.last, len(moe_layers(m))))
        else:  # a module with no plan: one chunk, nothing of it a formula knows but its params
            out.append(ChunkLayout(int(c), 0, True, True))
    return out


@dataclass
class Traffic:
    """Calls and bytes this rank moves in one step: per op (`calls`, `bytes`, what the ledger
    counts) and per (group, op) (`groups`: group name -> op -> [calls, bytes])."""

    calls: Counter = field(default_factory=Counter)
    bytes: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)

    def add(self, group: str, op: Op, n: int, nbytes: int, times: int = 1,
            calls: int | None = None) -> None:
        """`times` calls of `nbytes` each; or, given `calls`, that many moving `nbytes` in all."""
        if n <= 1 or times == 0 or calls == 0:
            return  # a collective on a group of one is a no-op, not counted
        moved = times * bus_bytes(op, n, nbytes)
        times = times if calls is None else calls
        self.calls[op] += times
        self.bytes[op] = self.bytes.get(op, Fraction(0)) + moved
        entry = self.groups.setdefault(group, {}).setdefault(op, [0, Fraction(0)])
        entry[0] += times
        entry[1] += moved

    @property
    def total(self) -> Fraction:
        return sum(self.bytes.values(), Fraction(0))


def _meta(record: PlacementRecord, dtype=torch.float32) -> list[tuple[str, torch.Tensor]]:
    """The held parameters as shapes only, in the engines' order."""
    return [(n, torch.empty(p.local_shape, dtype=dtype, device="meta"))
            for n, p in record.params.items()]


def _padded(numel: int, k: int) -> int:
    return -(-numel // k) * k


def _flats(cfg: Config, dims: ParallelDims, record: PlacementRecord):
    """The data-parallel engine's flat buffers (DDP's buckets, ZeRO's flat parameters), each as
    (the group it is reduced over, that group's size, the layout of its parameters, unpadded):
    dense parameters over the batch's ranks (dp x cp x ep, or dp_shard under hybrid sharding),
    experts over dp."""
    dense = ("batch", dims.batch) if dims.batch > dims.dp else \
        ("dp_shard" if dims.shard < dims.dp else "dp", dims.shard if cfg.parallel.zero else dims.dp)
    return [(*(("dp", dims.dp) if experts else dense), segments) for experts, segments, _ in
            _flat_layouts(record, cfg.parallel.zero, cfg.parallel.bucket_mb)]


@functools.lru_cache(maxsize=512)
def _flat_layouts(record: PlacementRecord, zero: int,
                  bucket_mb: float) -> list[tuple[bool, list[Segment], int]]:
    """(experts?, layout, group) per flat buffer, in the engine's order (`sync_classes`: dense
    first); the group is what is reduced at once: ZeRO-3's unit, else the buffer itself.
    Cached by the record's identity: a record is complete once `place` returns, and the planner
    prices many layouts on each."""
    named = _meta(record)
    experts = expert_overrides(record)
    groups = []
    if zero == 3:
        for u, unit in enumerate(map(set, record.units)):
            members = [(n, p) for n, p in named if n in unit]
            for cls in (False, True):
                for decay in (True, False):
                    groups.append((cls, [(n, p) for n, p in members if (n in experts) == cls
                                         and (p.dim() >= 2) == decay], u))
    else:
        for cls in (False, True):
            members = [(n, p) for n, p in named if (n in experts) == cls]
            if not members:
                continue
            if zero == 0:
                groups += [(cls, m, None) for m in assign_buckets(
                    members, int(bucket_mb * 2**20), int(min(1.0, bucket_mb) * 2**20))]
            else:
                groups += [(cls, m, None) for m, _ in flat_groups(members, bucket_mb)]
    kept = [(cls, layout(members), u) for cls, members, u in groups if members]
    return [(cls, segments, i if u is None else u) for i, (cls, segments, u) in enumerate(kept)]


def _compression(cfg: Config):
    """The configured method (for its formulas), or None."""
    par = cfg.parallel
    built = build_compression(par.compression, par.compression_ratio, par.compression_rank)
    return built.method if built is not None else None


def step_traffic(cfg: Config, dims: ParallelDims, record: PlacementRecord,
                 chunks: list[ChunkLayout]) -> Traffic:
    par, train = cfg.parallel, cfg.train
    t = Traffic()
    M = microbatches(par, dims)
    schedule = stage_schedule(par, dims.pp, M, checked=False)  # the schedule the run executes
    C, split = schedule.chunks, schedule.split_backward
    rows = train.global_batch // dims.rows // M
    seq, dim, T = cfg.data.seq_len // dims.cp, cfg.model.args().dim, dims.tp  # this rank's tokens
    bf16 = train.precision == "bf16"
    act_b = 2 if bf16 and par.zero else 4  # residual stream, its gradients, the embedding
    mm_b = 2 if bf16 else 4  # outputs of the row-parallel matmuls
    A = rows * seq * dim
    blocks = sum(c.layers for c in chunks)
    first = any(c.first for c in chunks)
    last = any(c.last for c in chunks)
    recompute = train.activation_checkpointing == "full"

    # Tensor (+ sequence) parallelism, per micro-batch. Full checkpointing recomputes a block's
    # forward up to the last tensor its backward needs (torch stops early): both block-half
    # inputs and the attention's output reduction, not the feed-forward's output reduction.
    # A split backward (zero-bubble) walks the graph twice on chunks after the first: the input
    # pass and the weight pass both run the backward collectives on the way to the norm gains.
    if T > 1:
        twice = sum(c.layers for c in chunks if c.index > 0) if split else 0
        head_twice = int(last and split and C > 1)
        if par.sequence_parallel:
            t.add("tp", Op.ALL_GATHER, T, A * act_b,
                  M * (2 * blocks * (1 + recompute) + first + last))
            t.add("tp", Op.ALL_GATHER, T, A * mm_b, M * 2 * (blocks + twice))
            t.add("tp", Op.REDUCE_SCATTER, T, A * mm_b, M * blocks * (2 + recompute))
            t.add("tp", Op.REDUCE_SCATTER, T, A * act_b,
                  M * (2 * (blocks + twice) + first + last + head_twice))
        else:
            t.add("tp", Op.ALL_REDUCE, T, A * mm_b, M * blocks * (2 + recompute))
            t.add("tp", Op.ALL_REDUCE, T, A * act_b,
                  M * (2 * (blocks + twice) + first + last + head_twice))
        if last:  # vocabulary-parallel cross-entropy: max, sum of exponentials, target logit
            t.add("tp", Op.ALL_REDUCE, T, rows * seq * 4, M * 3)
        # Each replicated parameter whose gradient is a partial sum over tp (under sequence
        # parallelism every one: norm gains, a router; else the plan's tp_partial_grads) is
        # all-reduced in each micro-batch's backward.
        for place in record.params.values():
            if "tp" in place.partial_grad:
                t.add("tp", Op.ALL_REDUCE, T, place.local_numel * act_b, M)

    # Context parallelism, per block and micro-batch.
    if dims.cp > 1:
        twice = sum(c.layers for c in chunks if c.index > 0) if split else 0
        _context_traffic(t, cfg, dims, rows, blocks, twice, M, mm_b)

    # Pipeline: activations forward, gradients back, per micro-batch and chunk boundary.
    message = A // (T if par.sequence_parallel else 1) * act_b
    for c in chunks:
        sends = (c.index < C - 1) + (c.index > 0)
        t.add("pp", Op.SEND, 2, message, M * sends)  # a send moves D whatever the group
        t.add("pp", Op.RECV, 2, 0, M * sends)

    # Mixture of experts, per MoE layer and micro-batch forward (again when recomputed): the
    # routing statistics summed over the batch's ranks; under ep the all-to-all of the counts per
    # expert (the token rows' all-to-alls depend on the routing: `all_to_all_bytes`); under tp
    # the router's partial gradient, summed in backward (with the other partial gradients above).
    moe = sum(c.moe for c in chunks)
    if moe:
        E = cfg.model.args().moe_experts
        t.add("batch", Op.ALL_REDUCE, dims.batch, 8 * (3 * E + 3), M * moe * (1 + recompute))
        t.add("ep", Op.ALL_TO_ALL, dims.ep, 8 * E, M * moe * (1 + recompute))

    # Data parallelism (compressed: once compression has started).
    method = _compression(cfg) if dims.shard > 1 else None
    R = dims.dp // dims.shard
    # (Summed per group and op first: bus bytes are linear in the bytes, and a 7B model has a
    # thousand buckets.)
    buffers = {}  # (group, op, n) -> [calls, bytes]

    def add(group: str, op: Op, n: int, nbytes: int, times: int = 1) -> None:
        entry = buffers.setdefault((group, op, n), [0, 0])
        entry[0], entry[1] = entry[0] + times, entry[1] + times * nbytes

    if par.zero == 0:
        for group, K, segments in _flats(cfg, dims, record):
            numel = members_numel(segments)
            reduction = (method.messages(segments, numel, K, sharded=False) if method
                         else [(Op.ALL_REDUCE, 4 * numel)])
            for op, nbytes in reduction:
                add(group, op, K, nbytes)
    else:
        param_b = 2 if bf16 else 4
        reduce_b = 2 if bf16 and par.reduce_dtype == "bf16" else 4
        gathers = 1 if par.zero < 3 else (2 * M if par.reshard_after_forward else 1)
        for group, K, segments in _flats(cfg, dims, record):
            padded = _padded(members_numel(segments), K)
            reduction = (method.messages(segments, padded, K, sharded=True) if method
                         else [(Op.REDUCE_SCATTER, padded * reduce_b)])
            for op, nbytes in reduction:
                add(group, op, K, nbytes)
            add(group, Op.ALL_GATHER, K, padded * param_b, gathers)
            add("dp_replicate", Op.ALL_REDUCE, R, padded // K * reduce_b)
    for (group, op, n), (calls, nbytes) in buffers.items():
        t.add(group, op, n, nbytes, calls=calls)

    # The global gradient norm (every step: clipping, and the non-finite check): over pp, tp, ep
    # and, under ZeRO, the sharding group (dp under ep: the dense slices' other axis is ep).
    storage = ("dp_shard", dims.shard) if dims.shard < dims.dp else \
        ("batch", dims.dp * dims.cp) if dims.cp > 1 else ("dp", dims.dp)
    for group, n in (("pp", dims.pp), ("tp", dims.tp), ("ep", dims.ep),
                     storage if par.zero else ("dp", 1)):
        t.add(group, Op.ALL_REDUCE, n, 8)
    return t


def _context_traffic(t: Traffic, cfg: Config, dims: ParallelDims, rows: int, blocks: int,
                     twice: int, M: int, elt: int) -> None:
    """Context parallelism's collectives on the cp axis, per micro-batch: for `blocks` blocks
    forward and backward (`twice` of them walked twice by a split backward) and again forward
    when recomputed. q, k and v are `elt` bytes per element (matmul outputs), at this rank's
    heads (n_heads / tp, n_kv_heads / tp).

    - ring: the key/value block (keys and values of the kv heads) shifted C - 1 times forward,
      C - 1 times again in backward with its fp32 gradient shifted C times (home at the end);
    - Ulysses: all-to-alls of q, k, v and the output forward, and of their gradients backward
      (k and v at the query heads when C does not divide the kv heads). A selective
      recomputation stops at attention (q, k, v only); a full one runs the output's too."""
    args, C, T = cfg.model.args(), dims.cp, dims.tp
    tokens = rows * cfg.data.seq_len // C  # this rank's, per micro-batch
    heads, kv_heads = args.n_heads // T, args.n_kv_heads // T
    mode = cfg.train.activation_checkpointing
    backward = blocks + twice
    if cfg.parallel.cp_method == "ring":
        block = 2 * tokens * kv_heads * args.head_dim
        forwards = blocks * (1 + (mode != "none"))
        t.add("cp", Op.SEND, C, block * elt, M * (C - 1) * (forwards + backward))
        t.add("cp", Op.SEND, C, block * 4, M * C * backward)
        return
    if kv_heads % C:
        kv_heads = heads
    q, kv = tokens * heads * args.head_dim * elt, tokens * kv_heads * args.head_dim * elt
    recomputed = {"full": 2, "selective": 1}.get(mode, 0)  # q and the output, or q alone
    t.add("cp", Op.ALL_TO_ALL, C, q, M * (2 * blocks + 2 * backward + recomputed * blocks))
    t.add("cp", Op.ALL_TO_ALL, C, kv, M * 2 * (blocks + backward + (mode != "none") * blocks))


def all_to_all_bytes(rows: list[tuple[int, int, bool]], dim: int, elt: int,
                     ep: int) -> Fraction:
    """Bytes this rank's token all-to-alls moved, from the rows each dispatch sent and received
    ((sent, received, with backward) per MoE forward, `AllToAllDispatch.rows`): the dispatch and
    the return in forward, both again in reverse in backward; (ep - 1) / ep of each input."""
    total = sum((s + r) * (2 if backward else 1) for s, r, backward in rows)
    return bus_bytes(Op.ALL_TO_ALL, ep, total * dim * elt)


def routed_traffic(t: Traffic, cfg: Config, dims: ParallelDims,
                   chunks: list[ChunkLayout]) -> None:
    """Adds to `t` the token all-to-alls of expert parallelism as a plan expects them (a run's
    depend on its routing: `all_to_all_bytes`): routing balanced and nothing dropped, so per MoE
    block and micro-batch each of the rank's tokens sends top_k rows out (dispatch) and gets them
    back (return), in forward, again when recomputed, and in reverse in backward."""
    moe = sum(c.moe for c in chunks)
    if not moe or dims.ep == 1:
        return
    args, M = cfg.model.args(), microbatches(cfg.parallel, dims)
    tokens = cfg.train.global_batch // dims.rows // M * cfg.data.seq_len // dims.cp
    # Bytes per element out (the block's residual dtype) and back (the experts' output: bf16
    # under autocast); backward sends the gradients of each the other way.
    bf16 = cfg.train.precision == "bf16"
    out, back = (2 if bf16 and cfg.parallel.zero else 4), (2 if bf16 else 4)
    passes = 2 + (cfg.train.activation_checkpointing == "full")
    t.add("ep", Op.ALL_TO_ALL, dims.ep, tokens * args.moe_top_k * args.dim * (out + back)
          * M * moe * passes, calls=2 * M * moe * passes)


def state_bytes(cfg: Config, dims: ParallelDims, record: PlacementRecord) -> dict[str, int]:
    """Model-state bytes this rank holds after a step: parameters, gradients, optimizer state
    (AdamW: two fp32 moments; under bf16 ZeRO also the fp32 master: 2 + 2 + 12 per parameter),
    ZeRO's shards padded to a multiple of the sharding group; with gradient compression, its
    state ("compression"); and "peak", the most held during the step (`_peak`)."""
    par = cfg.parallel
    bf16 = cfg.train.precision == "bf16" and par.zero > 0
    held = record.held_numel()
    flats = [(s, K, _padded(members_numel(s), K if par.zero else 1))
             for _, K, s in _flats(cfg, dims, record)]
    param_b = 2 if bf16 else 4
    reduce_b = 2 if bf16 and par.reduce_dtype == "bf16" else 4
    if par.zero == 0:
        state = {"params": 4 * held, "grads": 4 * held, "optimizer": 8 * held}
    else:
        padded = sum(numel for _, _, numel in flats)
        sliced = sum(numel // K for _, K, numel in flats)
        state = {"params": param_b * (sliced if par.zero == 3 else padded),
                 "grads": param_b * held if par.zero == 1 else reduce_b * sliced,
                 "optimizer": (12 if bf16 else 8) * sliced}
    method = _compression(cfg)
    if method is not None:  # error feedback, PowerSGD's Q: fp32, once compression has run
        state["compression"] = 4 * sum(method.state_numel(s, n) for s, _, n in flats) \
            if dims.dp > 1 else 0
    rest = sum(v for k, v in state.items() if k not in ("params", "grads"))
    if par.zero == 0:
        state["peak"] = sum(state.values())  # replicas hold it all, all step long
    else:
        groups = [u for *_, u in _flat_layouts(record, par.zero, par.bucket_mb)]
        schedule = stage_schedule(par, dims.pp, microbatches(par, dims), checked=False)
        kind = Kind.W if schedule.split_backward else Kind.B
        passes = [a.chunk for a in schedule.actions[record.coords["pp"]] if a.kind is kind]
        state["peak"] = rest + _params_peak(record, flats, groups, par, state["params"], param_b) \
            + _grads_peak(record, flats, groups, par.zero, passes, param_b, reduce_b)
    return state


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
    from plait.model.llama import BLOCK

    par = cfg.parallel
    bf16 = cfg.train.precision == "bf16" and par.zero > 0
    param_b = 2 if bf16 else 4
    flats = [(K, _padded(members_numel(s), K if par.zero else 1))
             for _, K, s in _flats(cfg, dims, record)]
    sliced = sum(n // K for K, n in flats)
    largest = max(p.local_numel for p in record.params.values())
    # Offload keeps the masters (and, "params", the slices) in host memory: not on the device.
    masters = 4 * sliced if bf16 and par.offload == "none" else 0
    blocks = 2 * 4 * min(BLOCK, largest)  # whole draw blocks at a slice's two ends
    if par.zero == 3:
        slices = 0 if par.offload == "params" else param_b * sliced
        return slices + masters + 16 * max(n // K for K, n in flats) + blocks
    return 4 * record.held_numel() + masters + blocks + max(
        8 * largest, (4 + param_b) * max(n for _, n in flats))


def _params_peak(record: PlacementRecord, flats, groups: list[int], par, params: int,
                 param_b: int) -> int:
    """The most parameter bytes held during a step. ZeRO-1/2: the whole replica, always.
    ZeRO-3: the slices plus the units gathered at once: a unit and the next one (prefetched, in
    the forward; the previous one in the backward) in each chunk, plus the chunk's first unit
    where it spans the chunk (tied embeddings, a wrap policy's leftover); every unit of the stage
    when they are kept from forward to backward (`reshard_after_forward = false`)."""
    if par.zero < 3:
        return params
    gathered = [0] * len(record.units)
    for (_, _, padded), unit in zip(flats, groups, strict=True):
        gathered[unit] += padded * param_b
    if not par.reshard_after_forward:
        return params + sum(gathered)
    most = 0
    for chunk in sorted(set(record.unit_chunks)):
        mine = [u for u, c in enumerate(record.unit_chunks) if c == chunk]
        span = gathered[mine[0]] if record.spanning[mine[0]] else 0
        rest = [gathered[u] for u in mine if not (u == mine[0] and span)]
        pairs = [a + b for a, b in zip(rest, rest[1:], strict=False)] or rest or [0]
        most = max(most, span + max(pairs))
    return params + most


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


__all__ = ["ChunkLayout", "Traffic", "chunk_layouts", "startup_bytes", "state_bytes",
           "step_traffic"]
