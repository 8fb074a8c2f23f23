"""Activation bytes per rank, from formulas: the peak of what autograd keeps for backward during
a step (the `activation_bytes` metric, counted by storage in `predict/activation_memory.py`), for
the planner and `--dry-run`, checked against measurement in the composition matrix.

Per micro-batch of r rows and s tokens, with A = r s dim elements, F = r s ffn_dim, T = tp and
S = T under sequence parallelism (else 1), one transformer block keeps, in fp32:

    none       per norm its input (A / S; `model.llama.Normalize` makes x / rms(x) again in
               backward, as a fused norm does) and its output as the matmuls
               read it (A; under sequence parallelism its shard, A / S, which the
               column-parallel linears gather again in backward:
               `parallel/sequence_parallel.py`); q and the attention output (2 A / T), k
               and v at their own head count (2 A kv_heads / heads / T: the kernel's
               grouped-query form); w1 x and w3 x (2 F / T: the gate is made again in
               backward, `model/feed_forward.py`); per token an rsqrt per norm (2 r s / S) and
               the attention's log-sum-exp per head (r s heads / T)
    selective  the matmuls' inputs and outputs: block input and mid-block residual (A / S
               each), the norm outputs the matmuls read (A each; A / S under SP), q, k, v at
               their own head counts and the attention output (/ T), w1 x and w3 x (2 F / T)
    full       the block input (A / S)

In bf16 (`_Sizes`; fp16 the same): matmul outputs take 2 bytes; under autocast over fp32 weights
each matmul keeps its own bf16 cast of its input (three of the attention norm's output, two of the
feed-forward norm's) and of its weight (but w2, which keeps its fp32 weight; under sequence
parallelism only wo: the column-parallel linears keep the fp32 shard and weight); with bf16 weights
(ZeRO) the residual stream is bf16, as each norm's input. Each chunk's forward keeps the rotary
tables; the first chunk the embedding's indices, the last chunk the final norm, a log-sum-exp per
token and the targets (the cross-entropy fused with the head never keeps the logits; where a micro-
batch's are one run at most, 2^24 on a CPU and 2^28 on a GPU, its softmax, fp32, as the unfused
loss). A stage holds what its schedule has in flight: the peak, walking its actions, of what each F
adds and each B (W under a split backward) frees.

The composition matrix asserts these equal to the measured peak on every rank of every row.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from plait.config.schema import Config, microbatches
from plait.mesh import ParallelDims
from plait.optim.loss_scaling import HALF
from plait.parallel.compile import compile_enabled
from plait.parallel.pipeline import stage_schedule
from plait.parallel.pipeline.simulator import peak_held
from plait.parallel.vocab_parallel import (
    MM_INTO_FP32,
    backward_bytes,
    compute_device,
    fits_one_run,
    run_tokens,
)
from plait.predict.state_cost import half_params


@dataclass(frozen=True)
class _Sizes:
    """Bytes per element of what a block keeps, by precision: `stream` for the residual stream
    (the parameters' dtype), `matmul` for matmul outputs (bf16 under autocast), and per norm
    `norm_local` (per element of its sequence shard) and `norm_out` (what the matmuls read,
    gathered under sequence parallelism). `norm_work`: per element, what the norm's autograd
    composition kept (its input and x / rms(x), and their casts), which the planner's
    elementwise passes were fitted to and still price (`block_bytes(priced=True)`): the norm
    keeps less now, and does the same work and more (x / rms(x) made again in backward)."""

    stream: int
    matmul: int
    norm_out: int
    weight_casts: bool  # autocast over fp32 weights keeps a bf16 copy of each matmul weight
    norm_work: int

    @property
    def norm_local(self) -> int:
        """What a norm keeps per element: its input, in the residual stream's dtype."""
        return self.stream

    @property
    def norm_outs(self) -> int:
        """Bytes per element of both norms' outputs as the matmuls keep them: autocast casts the
        input of each matmul separately, so q, k, v keep three casts and w1, w3 two."""
        return 5 * self.norm_out if self.weight_casts else 2 * self.norm_out


def _sizes(cfg: Config) -> _Sizes:
    if cfg.train.precision not in HALF:  # bf16 and fp16 keep the same sizes
        return _Sizes(4, 4, 4, False, 8)  # norm work: its input and x / rms(x) (fp32)
    if half_params(cfg):  # bf16 parameters; norm work: the fp32 upcast and a bf16 x / rms(x)
        return _Sizes(2, 2, 2, False, 6)
    return _Sizes(4, 2, 2, True, 8)  # autocast: the matmul reads a bf16 cast of the norm output


def block_bytes(cfg: Config, T: int, rows: int, C: int = 1, priced: bool = False) -> int:
    """What one block keeps for one micro-batch of `rows` rows on a rank of tp = T, cp = C
    (`priced`: with the norms' work as the planner's elementwise passes price it, `_Sizes`)."""
    shape, mode, b = cfg.model.shape(), cfg.train.activation_checkpointing, _sizes(cfg)
    local = b.norm_work if priced else b.norm_local
    S = T if cfg.parallel.sequence_parallel and T > 1 else 1
    shards = S > 1
    tokens = rows * cfg.data.seq_len // C
    A, Ff = tokens * shape.hidden, tokens * shape.ffn
    kv = Fraction(shape.kv_heads, shape.heads)
    if mode == "full":
        return b.stream * A // S
    if b.weight_casts and shards:
        # wo alone: the column-parallel linears keep their fp32 weight and the input's shard
        # (`parallel/sequence_parallel.py`), w2 its fp32 weight (`feed_forward.GatedDown`)
        casts = 2 * shape.hidden * shape.head_dim * shape.heads // T
    elif b.weight_casts:
        # w2 keeps its fp32 weight, not a cast (`feed_forward.GatedDown`)
        linear = 2 * shape.hidden * shape.head_dim * (shape.heads + shape.kv_heads) \
            + 2 * shape.hidden * shape.ffn
        casts = 2 * linear // T
    else:
        casts = 0
    # What the column-parallel matmuls keep of the two norms' outputs: under sequence
    # parallelism the shards (gathered again in backward), else the whole as they read it.
    norm_outs = 2 * b.stream * Fraction(A, S) if shards else b.norm_outs * A
    if mode == "selective":
        kept = (2 * b.stream * Fraction(A, S) + norm_outs
                + b.matmul * Fraction(A * (2 + 2 * kv) + 2 * Ff, T))
    else:
        # q, k, v, output: k and v at their own head counts (the kernel's grouped-query form,
        # ring attention's blocks alike). Ulysses's output comes back through an all-to-all into
        # a tensor of its own, beside the one attention keeps; with fewer key/value heads on a
        # rank than cp ranks it repeats them to every query head before its all-to-all.
        attention = 2 + 2 * kv
        if C > 1 and cfg.parallel.cp_method == "ulysses":
            attention = 5 if shape.kv_heads // T % C else 3 + 2 * kv
        kept = (2 * local * Fraction(A, S) + norm_outs
                + b.matmul * Fraction(attention * A + 2 * Ff, T)
                + 4 * Fraction(2 * tokens, S) + 4 * Fraction(tokens * shape.heads, T))
    return int(kept) + casts


def moe_extra_bytes(cfg: Config, dims: ParallelDims, rows: int) -> int:
    """What a mixture-of-experts block keeps beyond a dense block, for one micro-batch, with the
    routing balanced and nothing dropped (expert choice at capacity factor 1: each of the N
    tokens' k assignments, A = N k rows, is sent once and each rank receives as many): the
    router's logits and probabilities (N E, fp32), the z-loss's log-sum-exp (N) and the aux
    loss's fractions (E); int64 indices: the experts' sort of all N tokens (the choice is a
    slice of it), the gather of the rows and their scatter back (A each), across ep ranks also
    the arrivals' order by expert and back; the rows the experts read (A dim), their
    feed-forwards (2 A F / T: w1 x and w3 x, in place of the dense 2 N F / T),
    the gate weights (A), the expert outputs and their weighted copy (2 A dim). Token choice
    keeps other indices and routes unevenly: there it is an expectation, not an equality."""
    if cfg.train.activation_checkpointing == "full":
        return 0
    shape, T, b = cfg.model.shape(), dims.tp, _sizes(cfg)
    N = rows * cfg.data.seq_len // dims.cp
    E, A = shape.experts, N * shape.top_k
    router = 4 * (2 * N * E + N + E)
    indices = 8 * E * N + 8 * A * (2 + 2 * (dims.ep > 1))
    ffn = b.matmul * 2 * (A - N) * shape.ffn // T
    if b.weight_casts:  # autocast: each expert's w1 and w3 keep a bf16 cast of the rows, the
        # experts' bf16 output times the fp32 gate weight is fp32; each held expert's weights
        # are cast (the dense block counted one feed-forward's)
        rows_kept = (2 * 2 + 2 + 4) * A * shape.hidden + 4 * A
        casts = (E // dims.ep - 1) * 2 * 2 * shape.hidden * shape.ffn // T
    else:
        rows_kept, casts = 3 * b.matmul * A * shape.hidden + 4 * A, 0
    if cfg.parallel.sequence_parallel and T > 1:
        # The router and the experts read the gathered input as a dense block's feed-forward
        # did before its linears kept the shard (`block_bytes`): that, not the shard; and the
        # one feed-forward's weight casts the dense block no longer counts.
        whole = (2 if b.weight_casts else 1) * b.norm_out * N * shape.hidden
        casts += 2 * 2 * shape.hidden * shape.ffn // T if b.weight_casts else 0
        rows_kept += whole - b.stream * N * shape.hidden // T
    return router + indices + rows_kept + ffn + casts


def microbatch_bytes(cfg: Config, dims: ParallelDims, layers: int, first: bool, last: bool,
                     rows: int, moe: int, priced: bool = False) -> int:
    """One chunk's activations for one micro-batch of `rows` rows; `moe` of its blocks are
    mixtures of experts (`priced`: `block_bytes`'s)."""
    shape, T, C, b = cfg.model.shape(), dims.tp, dims.cp, _sizes(cfg)
    local = b.norm_work if priced else b.norm_local
    S = T if cfg.parallel.sequence_parallel and T > 1 else 1
    tokens = rows * cfg.data.seq_len // C
    A = tokens * shape.hidden
    total = layers * block_bytes(cfg, T, rows, C, priced) + moe * moe_extra_bytes(cfg, dims, rows)
    if layers:  # the rotary tables (cos, sin: seq / C x head_dim / 2 each), one pair per forward
        total += 4 * cfg.data.seq_len // C * shape.head_dim
    if first and T > 1:  # vocabulary-parallel lookup: local indices (int64) and the mask (bool)
        total += 9 * tokens
    if last and not fits_one_run(tokens, shape.vocab // T, compute_device(cfg)):
        # Final norm (as a block's; its output, the head's input, in the stream's dtype: the
        # cross-entropy fused with the head keeps it, not a cast), and per token the fp32
        # log-sum-exp of the logits (never kept: `vocab_parallel.linear_cross_entropy`) and the
        # targets, an int64 copy where the rows are not contiguous (one row, or context
        # parallelism's contiguous copy: a view, counted in `activation_bytes`).
        total += local * A // S + b.stream * A + 4 * tokens // S + 4 * tokens
        total += 8 * tokens if rows > 1 and C == 1 else 0
    elif last:  # logits of one run at most, kept as the unfused loss keeps them
        # Final norm (as a block's), the head's weight cast under autocast, the fp32 softmax
        # of the logits, and the targets: at tp = 1 a contiguous int64 copy (and a float32
        # scalar), vocabulary-parallel the local target (int64) and its mask (bool).
        total += (local * A // S + b.norm_out * A + 4 * tokens // S
                  + 4 * tokens * shape.vocab // T)
        total += 2 * shape.hidden * shape.vocab // T if b.weight_casts else 0
        total += 9 * tokens if T > 1 else (8 * tokens if rows > 1 and C == 1 else 0) + 4
    return total


def activation_bytes(cfg: Config, dims: ParallelDims, chunks) -> int:
    """Peak bytes this rank keeps for backward in a step; `chunks` are its ChunkLayouts."""
    par = cfg.parallel
    M = microbatches(par, dims)
    schedule = stage_schedule(par, dims.pp, M, checked=False)
    rows = cfg.train.global_batch // dims.rows // M
    stage = chunks[0].index % dims.pp
    per_chunk = {c.index: microbatch_bytes(cfg, dims, c.layers, c.first, c.last, rows, c.moe)
                 for c in chunks}
    peak = peak_held(schedule, stage, per_chunk.__getitem__)
    # The token window of the rank's batch (inputs and targets are views of one (rows, seq + 1)
    # int64 tensor), saved whole by the embedding at tp = 1, and by the loss when a micro-batch
    # is one row (its targets then flatten to a view). Under context parallelism inputs and
    # targets are this rank's copies (rows, seq / C): at tp = 1 the embedding keeps the one, the
    # loss the other.
    first, last = any(c.first for c in chunks), any(c.last for c in chunks)
    window = cfg.train.global_batch // dims.rows * (cfg.data.seq_len + 1)
    # The fused loss keeps the targets (a view at one row, or of cp's copy) at any tp.
    fused = not fits_one_run(rows * cfg.data.seq_len // dims.cp,
                             cfg.model.shape().vocab // dims.tp, compute_device(cfg))
    targets = last and (fused or dims.tp == 1)
    if dims.cp > 1:
        peak += 8 * cfg.train.global_batch // dims.rows * cfg.data.seq_len // dims.cp \
            * (first * (dims.tp == 1) + targets)
    elif dims.tp == 1 and first or targets and rows == 1:
        peak += 8 * window
    return peak


def loss_backward_bytes(cfg: Config, dims: ParallelDims) -> int:
    """What the last stage's fused cross-entropy holds at its most in its backward, on top of the
    activations (`vocab_parallel.backward_bytes`: the logits of a run, the head's gradient in
    fp32); 0 where a micro-batch's logits are one run (kept whole, counted as activations)."""
    shape, b = cfg.model.shape(), _sizes(cfg)
    tokens = cfg.train.global_batch // dims.rows // microbatches(cfg.parallel, dims) \
        * cfg.data.seq_len // dims.cp
    vocab, device = shape.vocab // dims.tp, compute_device(cfg)
    if fits_one_run(tokens, vocab, device):
        return 0
    gpu = device == "cuda"
    return backward_bytes(tokens, vocab, shape.hidden, run_tokens(vocab, device), b.matmul,
                          b.stream, b.stream, compiled=compile_enabled(cfg.train.compile,
                                                                       torch.device(device)),
                          into_fp32=gpu and (b.matmul == 4 or MM_INTO_FP32))


def regathered_bytes(cfg: Config, dims: ParallelDims, rows: int, layers: int, moe: int = 0) -> int:
    """Per micro-batch, the elementwise traffic of sequence parallelism's gathered inputs
    (`parallel/sequence_parallel.py`): each half's input is gathered in forward and again in
    backward, and goes from the all-gather to the column-parallel matmuls, which read it as it
    is; only autocast over fp32 parameters casts it first (the fp32 gather read, a bf16 copy
    written: 6 bytes an element), in forward once per linear (q, k, v; w1, w3), in backward
    once per half. A mixture of experts' feed-forward keeps its gathered input and is not
    gathered again (its casts are its activations'). 0 without sequence parallelism and where
    the gathered input is already the matmuls' dtype (bf16 parameters, fp32)."""
    if not (cfg.parallel.sequence_parallel and dims.tp > 1) or not _sizes(cfg).weight_casts:
        return 0
    whole = rows * cfg.data.seq_len // dims.cp * cfg.model.shape().hidden
    casts = layers * (3 + 1) + (layers - moe) * (2 + 1)  # attention's half, the feed-forward's
    return casts * whole * (4 + 2)
