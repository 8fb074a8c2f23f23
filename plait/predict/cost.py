"""What one training step costs a rank, from formulas: the bytes and calls of every collective it
issues, and (`state_cost.py`, re-exported here) the model-state bytes it holds. The engine's
ledger and state accounting are asserted equal to these in the composition matrix; `plait train
--dry-run` prints them without starting a process, and the planner uses the same functions.

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

Dtypes (bf16 and fp16 alike, "half"): the residual stream and its gradients are half only with
half parameters (`train.param_dtype`; by default ZeRO with a half precision); matmul outputs are
half under any half-precision training (autocast).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

from plait.comm import Op, bus_bytes
from plait.comm.compression import members_numel, replica_segment
from plait.config.schema import Config, microbatches
from plait.mesh import ParallelDims, dp_per_node, ranks_per_node
from plait.model.plan import has_plan, plan_of
from plait.optim.loss_scaling import HALF
from plait.optim.muon_routes import (
    DataGroup,
    MatrixBuffer,
    Routes,
    newton_schulz_flops,
    plan_matrices,
)
from plait.parallel.expert_parallel import moe_layers
from plait.parallel.pipeline import stage_schedule
from plait.parallel.placement import PlacementRecord
from plait.parallel.vocab_parallel import compute_device, run_tokens
from plait.predict.state_cost import (  # noqa: F401 - re-exported
    compression_method,
    dtype_bytes,
    flat_buffers,
    half_params,
    matrices,
    padded_numel,
    startup_bytes,
    state_bytes,
    unprefetched_share,
)


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


@dataclass(frozen=True)
class _Step:
    """What one rank's step looks like to the traffic formulas: its schedule's micro-batches
    `M` and chunks `C` (`split`: a split backward), each micro-batch's rows and this rank's
    tokens of a row, element sizes, and its chunks' blocks."""

    M: int
    C: int
    split: bool
    rows: int
    seq: int  # tokens of a row on this rank (seq_len / cp)
    T: int  # tp
    act_b: int  # residual stream, its gradients, the embedding
    mm_b: int  # outputs of the row-parallel matmuls
    A: int  # elements of a micro-batch's residual stream: rows x seq x dim
    blocks: int
    first: bool
    last: bool
    recompute: bool  # full activation checkpointing
    twice: int  # blocks a split backward walks twice (chunks after the first)
    # Block halves whose column-parallel linears keep their input's shard under sequence
    # parallelism (all but a mixture of experts' feed-forward), per backward pass over them.
    regathered: int = 0

    @staticmethod
    def of(cfg: Config, dims: ParallelDims, chunks: list[ChunkLayout]) -> _Step:
        par, train = cfg.parallel, cfg.train
        M = microbatches(par, dims)
        schedule = stage_schedule(par, dims.pp, M, checked=False)  # the schedule the run executes
        rows = train.global_batch // dims.rows // M
        seq = cfg.data.seq_len // dims.cp
        half = train.precision in HALF  # bf16 or fp16: the same sizes
        split = schedule.split_backward
        return _Step(M, schedule.chunks, split, rows, seq, dims.tp, 2 if half_params(cfg) else 4,
                     2 if half else 4, rows * seq * cfg.model.shape().hidden,
                     sum(c.layers for c in chunks), any(c.first for c in chunks),
                     any(c.last for c in chunks), train.activation_checkpointing == "full",
                     sum(c.layers for c in chunks if c.index > 0) if split else 0,
                     sum((2 * c.layers - c.moe) * (1 + (split and c.index > 0)) for c in chunks))


def step_traffic(cfg: Config, dims: ParallelDims, record: PlacementRecord,
                 chunks: list[ChunkLayout]) -> Traffic:
    """Every collective one training step issues on this rank (the stage whose `chunks` these
    are), per group, op and group size: one function per axis."""
    t, step = Traffic(), _Step.of(cfg, dims, chunks)
    if step.T > 1:
        _tensor_traffic(t, cfg, record, step)
    if dims.cp > 1:
        _context_traffic(t, cfg, dims, step.rows, step.blocks, step.twice, step.M, step.mm_b)
    _pipeline_traffic(t, cfg, chunks, step)
    _moe_traffic(t, cfg, dims, chunks, step)
    _data_traffic(t, cfg, dims, record, step)
    _norm_traffic(t, cfg, dims)
    _muon_traffic(t, cfg, dims, record)
    return t


def muon_routes(cfg: Config, dims: ParallelDims, record: PlacementRecord):
    """Muon's exchange on this rank (`optim.muon.Routes`), from the flat buffers the engine
    lays out; None for other optimizers."""
    names = matrices(cfg, record)
    if not names:
        return None
    c, zero = record.coords, cfg.parallel.zero
    batch = dims.batch_index(c)
    index = {"dp": c["dp"], "dp_shard": batch % dims.shard_ranks,
             "dp_shard_experts": c["dp"] % dims.shard, "batch": batch}
    groups, buffers = {}, []
    for group, K, segments in flat_buffers(cfg, dims, record):
        sharded = zero > 0 and K > 1
        data = groups.setdefault((group, sharded), DataGroup(group, K, index[group], sharded))
        shard = padded_numel(members_numel(segments), K) // K if sharded else 0
        buffers.append(MatrixBuffer(data, tuple(segments), shard))
    found = plan_matrices(buffers, names, record, dims.tp)
    return Routes(found, c["tp"], dims.tp)


def muon_flops(cfg: Config, dims: ParallelDims, record: PlacementRecord,
               slowest: bool = False) -> int:
    """Newton-Schulz FLOPs of a Muon step on this rank (the matrices it owns), or, `slowest`,
    on the most loaded rank of each data group (what sets the step's pace); 0 for other
    optimizers."""
    routes = muon_routes(cfg, dims, record)
    if routes is None:
        return 0
    steps = cfg.train.muon_ns_steps
    if not slowest:
        return sum(newton_schulz_flops(m.shape, steps) for m in routes.owned())
    total = 0
    for data in routes.groups:
        loads = Counter()
        for m in routes.of(data):
            loads[m.owner] += newton_schulz_flops(m.shape, steps)
        total += max(loads.values())
    return total


def _muon_traffic(t: Traffic, cfg: Config, dims: ParallelDims, record: PlacementRecord) -> None:
    """Muon: per step, each matrix's update to its owner and the orthogonalized one back, in bf16
    (`optim/muon.py`): an all-to-all over each data group whose ranks hold slices (ZeRO), two
    over tp, and one back over each data group."""
    routes = muon_routes(cfg, dims, record)
    for data, elements in routes.traffic() if routes is not None else []:
        group, n = (data.group, data.size) if data is not None else ("tp", dims.tp)
        t.add(group, Op.ALL_TO_ALL, n, 2 * elements)


def _tensor_traffic(t: Traffic, cfg: Config, record: PlacementRecord, s: _Step) -> None:
    """Tensor (+ sequence) parallelism, per micro-batch. Full checkpointing recomputes a block's
    forward up to the last tensor its backward needs (torch stops early): both block-half
    inputs and the attention's output reduction, not the feed-forward's output reduction. A
    split backward (zero-bubble) walks the graph twice on chunks after the first: the input
    pass and the weight pass both run the backward collectives on the way to the norm gains."""
    M, T, A, blocks, twice = s.M, s.T, s.A, s.blocks, s.twice
    ends = s.first + s.last
    head_twice = int(s.last and s.split and s.C > 1)
    if cfg.parallel.sequence_parallel:
        # Each half's input gathered on the way in (again when recomputed), and again in each
        # backward pass for its column-parallel linears, which keep the shard
        # (`parallel/sequence_parallel.py`).
        t.add("tp", Op.ALL_GATHER, T, A * s.act_b,
              M * (2 * blocks * (1 + s.recompute) + ends + s.regathered))
        t.add("tp", Op.ALL_GATHER, T, A * s.mm_b, M * 2 * (blocks + twice))
        t.add("tp", Op.REDUCE_SCATTER, T, A * s.mm_b, M * blocks * (2 + s.recompute))
        t.add("tp", Op.REDUCE_SCATTER, T, A * s.act_b,
              M * (2 * (blocks + twice) + ends + head_twice))
    else:
        t.add("tp", Op.ALL_REDUCE, T, A * s.mm_b, M * blocks * (2 + s.recompute))
        t.add("tp", Op.ALL_REDUCE, T, A * s.act_b, M * (2 * (blocks + twice) + ends + head_twice))
    if record.split_norms and blocks:
        # Norms over a tp-split width (OLMo2's q/k norms): their fp32 sums of squares over the
        # whole sequence, all-reduced forward (again when recomputed) and backward (again in a
        # split backward's second walk).
        per_block = len(record.split_norms) // blocks
        t.add("tp", Op.ALL_REDUCE, T, s.rows * s.seq * 4,
              M * per_block * (blocks * (2 + s.recompute) + twice))
    if s.last:  # vocabulary-parallel cross-entropy: max, sum of exponentials, target logit,
        # per run of tokens (`vocab_parallel.linear_cross_entropy`)
        tokens, vocab = s.rows * s.seq, cfg.model.shape().vocab // T
        per = run_tokens(vocab, compute_device(cfg))
        t.add("tp", Op.ALL_REDUCE, T, per * 4, M * 3 * (tokens // per))
        t.add("tp", Op.ALL_REDUCE, T, tokens % per * 4, M * 3 * bool(tokens % per))
    # Each replicated parameter whose gradient is a partial sum over tp (under sequence
    # parallelism every one: norm gains, a router; else the plan's tp_partial_grads) is
    # all-reduced in each micro-batch's backward.
    for place in record.params.values():
        if "tp" in place.partial_grad:
            t.add("tp", Op.ALL_REDUCE, T, place.local_numel * s.act_b, M)


def _pipeline_traffic(t: Traffic, cfg: Config, chunks: list[ChunkLayout], s: _Step) -> None:
    """Activations forward, gradients back, per micro-batch and chunk boundary."""
    message = s.A // (s.T if cfg.parallel.sequence_parallel else 1) * s.act_b
    for c in chunks:
        sends = (c.index < s.C - 1) + (c.index > 0)
        t.add("pp", Op.SEND, 2, message, s.M * sends)  # a send moves D whatever the group
        t.add("pp", Op.RECV, 2, 0, s.M * sends)


def _moe_traffic(t: Traffic, cfg: Config, dims: ParallelDims, chunks: list[ChunkLayout],
                 s: _Step) -> None:
    """Mixture of experts, per MoE layer and micro-batch forward (again when recomputed): the
    routing statistics summed over the batch's ranks; under ep the all-to-all of the counts per
    expert (the token rows' all-to-alls depend on the routing: `all_to_all_bytes`); under tp
    the router's partial gradient, summed in backward (with the other partial gradients)."""
    moe = sum(c.moe for c in chunks)
    if moe:
        E, times = cfg.model.shape().experts, s.M * moe * (1 + s.recompute)
        t.add("batch", Op.ALL_REDUCE, dims.batch, 8 * (3 * E + 3), times)
        t.add("ep", Op.ALL_TO_ALL, dims.ep, 8 * E, times)


def _data_traffic(t: Traffic, cfg: Config, dims: ParallelDims, record: PlacementRecord,
                  s: _Step) -> None:
    """Data parallelism (compressed: once compression has started), per flat buffer: DDP's
    all-reduce (hierarchical: within the node, across the nodes on 1/node of it, within), or
    ZeRO's reduce-scatter, its gathers and, hybrid, the all-reduce of the slices across groups.
    Summed per group and op first: bus bytes are linear in the bytes, and a 7B model has a
    thousand buckets."""
    par = cfg.parallel
    method = compression_method(cfg)  # where a buffer's group has more than one rank
    buffers = {}  # (group, op, n) -> [calls, bytes]

    def add(group: str, op: Op, n: int, nbytes: int, times: int = 1) -> None:
        entry = buffers.setdefault((group, op, n), [0, 0])
        entry[0], entry[1] = entry[0] + times, entry[1] + times * nbytes

    node = dp_per_node(dims, ranks_per_node(par.ranks_per_node, dims.world_size)) \
        if par.allreduce == "hierarchical" and not method else 0
    if par.zero == 0:
        for group, K, segments in flat_buffers(cfg, dims, record):
            numel = members_numel(segments)
            if node:  # within the node (its dp ranks' cp and ep ranks; the experts' its dp
                # ranks), across the nodes (1/local of it), within (allreduce.py)
                experts = group == "dp" and dims.ep > 1
                within, local = ("dp_node_experts", node) if experts else \
                    ("dp_node", node * dims.cp * dims.ep)
                padded = padded_numel(numel, local)
                add(within, Op.REDUCE_SCATTER, local, 4 * padded)
                add("dp_nodes", Op.ALL_REDUCE, dims.dp // node, 4 * padded // local)
                add(within, Op.ALL_GATHER, local, 4 * padded)
                continue
            reduction = (method.messages(segments, numel, K, sharded=False) if method and K > 1
                         else [(Op.ALL_REDUCE, 4 * numel)])
            for op, nbytes in reduction:
                add(group, op, K, nbytes)
    else:
        _sharded_traffic(add, cfg, dims, record, s, method)
    for (group, op, n), (calls, nbytes) in buffers.items():
        t.add(group, op, n, nbytes, calls=calls)


def _sharded_traffic(add, cfg: Config, dims: ParallelDims, record: PlacementRecord, s: _Step,
                     method) -> None:
    """ZeRO's part of `_data_traffic`, per flat buffer: the reduce-scatter over its group
    (compressed, but under hybrid sharding), the gathers and, hybrid, the all-reduce of the
    slices across the replicas (compressed there)."""
    par, R = cfg.parallel, dims.dp // dims.shard
    param_b, reduce_b = dtype_bytes(cfg)
    gathers = 1 if par.zero < 3 else (2 * s.M if par.reshard_after_forward else 1)
    for group, K, segments in flat_buffers(cfg, dims, record):
        padded = padded_numel(members_numel(segments), K)
        reduction = (method.messages(segments, padded, K, sharded=True)
                     if method and K > 1 and not dims.hybrid
                     else [(Op.REDUCE_SCATTER, padded * reduce_b)])
        for op, nbytes in reduction:
            add(group, op, K, nbytes)
        add(group, Op.ALL_GATHER, K, padded * param_b, gathers)
        slice_numel = padded // K
        replicas = (method.messages([replica_segment(slice_numel)], slice_numel, R, sharded=False)
                    if method and R > 1 else [(Op.ALL_REDUCE, slice_numel * reduce_b)])
        for op, nbytes in replicas:
            add("dp_replicate", op, R, nbytes)


def _norm_traffic(t: Traffic, cfg: Config, dims: ParallelDims) -> None:
    """The global gradient norm (every step: clipping, and the non-finite check): over pp, tp,
    ep and, under ZeRO, the sharding group (dp under ep: the dense slices' other axis is ep)."""
    storage = ("batch", dims.dp * dims.cp) if dims.cp > 1 else ("dp", dims.dp)
    if dims.hybrid:  # the dense shard group, or with ep its dp part, the experts' (then ep)
        storage = ("dp_shard_experts", dims.shard) if dims.ep > 1 else \
            ("dp_shard", dims.shard_ranks)
    for group, n in (("pp", dims.pp), ("tp", dims.tp), ("ep", dims.ep),
                     storage if cfg.parallel.zero else ("dp", 1)):
        t.add(group, Op.ALL_REDUCE, n, 8)


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
    shape, C, T = cfg.model.shape(), dims.cp, dims.tp
    tokens = rows * cfg.data.seq_len // C  # this rank's, per micro-batch
    heads, kv_heads = shape.heads // T, shape.kv_heads // T
    mode = cfg.train.activation_checkpointing
    backward = blocks + twice
    if cfg.parallel.cp_method == "ring":
        block = 2 * tokens * kv_heads * shape.head_dim
        forwards = blocks * (1 + (mode != "none"))
        t.add("cp", Op.SEND, C, block * elt, M * (C - 1) * (forwards + backward))
        t.add("cp", Op.SEND, C, block * 4, M * C * backward)
        return
    if kv_heads % C:
        kv_heads = heads
    q, kv = tokens * heads * shape.head_dim * elt, tokens * kv_heads * shape.head_dim * elt
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
    shape, M = cfg.model.shape(), microbatches(cfg.parallel, dims)
    tokens = cfg.train.global_batch // dims.rows // M * cfg.data.seq_len // dims.cp
    # Bytes per element out (the block's residual dtype) and back (the experts' output: half
    # under autocast); backward sends the gradients of each the other way.
    half = cfg.train.precision in HALF
    out, back = (2 if half_params(cfg) else 4), (2 if half else 4)
    passes = 2 + (cfg.train.activation_checkpointing == "full")
    t.add("ep", Op.ALL_TO_ALL, dims.ep, tokens * shape.top_k * shape.hidden * (out + back)
          * M * moe * passes, calls=2 * M * moe * passes)


__all__ = ["ChunkLayout", "Traffic", "chunk_layouts", "startup_bytes", "state_bytes",
           "step_traffic"]
