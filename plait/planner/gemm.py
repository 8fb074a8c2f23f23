"""A GPU step's compute time from its shapes: the matrix products by their sizes, attention by
its sequence length, and the elementwise work and the optimizer by the bytes they move.

Matrix products (`gemm_seconds`): the device computes C (m x n) in tiles of 128 x 256, one tile
per multiprocessor (SM) at a time, so a product takes ceil(tiles / SMs) waves, each as long as
one tile's loop over k (plus 256 of k for the loop's start and end) at the SMs' share of the
achieved peak; where there are fewer tiles than SMs, k is split among the idle ones (pieces of
at least 512, fp8 1,024); a memory-bound floor (operands read, result written once, at 85% of
the memory bandwidth) and a launch (4 us, fp8 8). The achieved peak is 74% of the datasheet's
dense bf16 (64% of the fp8 one, twice bf16's): the constants are fitted to 147 bf16 and 147 fp8
products measured on an H200 (`plait bench gemm`, tests/data/gemm_h200.json; median error 5%
bf16, 7% fp8; the worst, 40%, are products 512 wide), and assumed for every device, with its
own SM count and bandwidth (`hardware.Device`, datasheets).

A step's matmuls are its linear layers' (`matmul_rate`): per weight (out x in, as this rank
holds it under tp and ep) and micro-batch of m tokens, forward (m, out, in), the input's gradient
(m, in, out) and the weight's (out, in, m); a routed expert's m is the share of tokens routed to
it; full checkpointing repeats the blocks' forwards (not the head's). Their rate over the
layout's own shapes prices all its matmul FLOPs (a Hugging Face model's counted by its trace).

Attention (torch's fused kernel, forward and backward), counted as PaLM counts it (12 s d per
token and layer, the causal mask's skipped half included, so its rate is twice the kernel's),
the rate of torch 2.11's kernel on Hopper (cuDNN's; an engine on FlashAttention-2, as torch
ran before, at `FLASH2_SHARE` of it):
56% of the dense peak at 2K tokens and 94% at 8K (32 heads of 128, measured on the same H200),
log-linear in the length between, and no more beyond: a later sweep on that H200 (batches of 32K
tokens, torch 2.11's SDPA) measured 90% at 8K, 92.5% at 16K, 94.4% at 32K and 94.1% at 64K.
Elementwise work (norms, rotary, activations, casts, the softmax of the loss) is memory-bound: a
step moves a multiple of the bytes of the activations it would keep without checkpointing, the
engine's `elementwise_passes` (`hardware.Engine`: plait's eager step 26, calibrated on a 1B step
on the H200 and checked on a 125M one and on full checkpointing, docs/planning.md; an engine of
fused kernels 4; compiled blocks `compiled_passes`), a third more under full recomputation. The
optimizer moves the engine's `optimizer_bytes` per element of its state's slice (AdamW foreach:
96, measured as 33 ms for 1.5B on the H200; fused: 28).
"""

from __future__ import annotations

import math

TILE_M, TILE_N = 128, 256
TILE_K_EXTRA = 256  # the k-loop's start and end, in units of k
SPLIT_K_MIN = {"bf16": 512, "fp8": 1024}  # the smallest piece of k an idle SM takes
LAUNCH_S = {"bf16": 4e-6, "fp8": 8e-6}  # fp8's: its scales' handling too
MEMORY_SHARE = 0.85  # of the datasheet's bandwidth a streaming kernel reaches
PEAK_SHARE = {"bf16": 0.74, "fp8": 0.64}  # of the datasheet's dense peak, large products
ATTENTION_SHARE = ((2048, 0.56), (8192, 0.94))  # measured, forward + backward (PaLM's count)
ATTENTION_MAX = 0.94  # saturated: 16K to 64K tokens measured 0.925-0.944
# FlashAttention-2's rate against cuDNN's on an H100 SXM, forward and backward alike at 2K-16K
# tokens, head dim 128 (Shah et al. 2024, "FlashAttention-3", figures 5-6: 298-335 against
# 484-539 TFLOP/s forward, 291-322 against 465-518 backward). The sweep above ran torch 2.11,
# whose SDPA prefers cuDNN's kernel on Hopper (its backend was not recorded, but its 0.94 is
# 465 TFLOP/s of executed work, beyond FlashAttention-2's ~320 on the same SMs); torch of
# 2024-2025 ran FlashAttention-2 first (cuDNN's kernel opt-in: pytorch/pytorch#138522).
FLASH2_SHARE = 0.62


def gemm_seconds(m: int, n: int, k: int, device, fp8: bool = False) -> float:
    """Seconds of one (m x k) @ (k x n) product on `device` (a `hardware.Device`)."""
    kind = "fp8" if fp8 else "bf16"
    peak = device.peak_flops * (2 if fp8 else 1) * PEAK_SHARE[kind]
    tiles = math.ceil(m / TILE_M) * math.ceil(n / TILE_N)
    split = max(1, min(device.sms // tiles, k // SPLIT_K_MIN[kind]))
    waves = math.ceil(tiles * split / device.sms)
    compute = waves * 2 * TILE_M * TILE_N * (k / split + TILE_K_EXTRA) / (peak / device.sms)
    size = 1 if fp8 else 2
    memory = ((m * k + n * k) * size + m * n * 2) / (device.hbm_gbps * 1e9 * MEMORY_SHARE)
    return max(compute, memory) + LAUNCH_S[kind]


def matmul_rate(weights, tokens: float, device) -> float:
    """FLOP/s of a step's linear layers: `weights` are (out, in, share of the tokens it sees,
    in fp8, its forward run again by full recomputation) per weight, `tokens` a micro-batch's;
    forward, both gradients, and the second forward where there is one."""
    flops = seconds = 0.0
    for out, inner, share, fp8, recompute in weights:
        m = max(1, round(tokens * share))
        forward = gemm_seconds(m, out, inner, device, fp8)
        seconds += forward * (2 if recompute else 1) + gemm_seconds(m, inner, out, device, fp8) \
            + gemm_seconds(out, inner, m, device, fp8)
        flops += 2 * m * out * inner * (4 if recompute else 3)
    return flops / seconds if seconds else device.peak_flops * PEAK_SHARE["bf16"]


def attention_rate(seq: int, device) -> float:
    """FLOP/s of causal attention over `seq` tokens (forward and backward)."""
    (s0, a0), (s1, a1) = ATTENTION_SHARE
    share = a0 + (a1 - a0) * math.log2(max(seq, 1) / s0) / math.log2(s1 / s0)
    return device.peak_flops * min(ATTENTION_MAX, max(0.02, share))


def fp8_cast_bytes(out: int, inner: int, tokens: float) -> float:
    """Bytes an fp8 linear layer's casts move per micro-batch (torchao's dynamic tensorwise
    scaling: each operand's absolute maximum read, then read again, scaled and written in fp8:
    5 bytes per bf16 element) for its input, its weight and its output's gradient."""
    return 5 * (tokens * inner + out * inner + tokens * out)


def memory_seconds(nbytes: float, device) -> float:
    """Seconds to stream `nbytes` through device memory."""
    return nbytes / (device.hbm_gbps * 1e9 * MEMORY_SHARE)
