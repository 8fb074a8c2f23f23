"""The planner against published runs on GPU clusters (`plait bench plan --which published`):
each run's model, cluster, batch and layout pinned as published, its throughput and (where
published) its memory against the plan's.

Sources (each row names its own):
- Megatron-LM: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM" (SC21), Table 1: GPT models of vocabulary 51,200 and 2,048 tokens
  on A100 SXM 80 GB (DGX A100 nodes), tensor parallelism within a node, full activation
  recomputation, no ZeRO; throughput as teraFLOP/s per GPU counting recomputation, 96 B s l h^2
  (1 + s / 6h + V / 16lh) FLOPs per batch. The schedule is not named per row: the interleaved one
  (the paper's own) is assumed where pp > 1; micro-batches are the planner's best for the
  layout. Megatron-LM fused its elementwise kernels and all-reduced the gradients after the
  backward (its "local" DDP of 2021), on half parameters (no autocast casts), without
  sequence parallelism (Korthikanti et al. 2022 came later: pinned off): `megatron-2021`.
- Llama 3: Llama Team 2024, "The Llama 3 Herd of Models", Table 4: 405B at 8,192 tokens on
  H100 SXM 80 GB, tp 8, pp 16, ZeRO-1; MFU 43% and 41% (model FLOPs per token 6N + 6 l s d, as
  plait counts). Recomputation and micro-batches are the planner's best that fit; priced as
  `megatron` (sequence parallelism, reductions overlapped with the backward).
- torchtitan: benchmarks/llama3_h100_202412_torchtitan.md (Tables 1-6, December 2024) and
  benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (the vanilla-TP rows) in
  github.com/pytorch/torchtitan: Llama 3.1 8B / 70B / 405B at 8,192 tokens (or as the row
  says) on Grand Teton's H100s (96 GB HBM2e, 500 W: `h100-96gb`), and docs/performance.md as of
  2024-12-03 (commit 4d88a8a): Llama 3 8B and 70B on 64 A100 80 GB, local batch 1, eager (its
  "selective op" row for the 8B); FSDP (ZeRO-3), the layout,
  local batch, checkpointing and precision of each table; tokens/s per GPU and the peak memory
  (GiB) measured; one forward per step where there is no pipeline (no accumulation). Eager and
  torch.compile rows alike are priced with plait's eager engine (what compile's fusion saves is
  not modeled: those rows are expected slower than published), Float8 rows with fp8 matmuls
  (`hardware.planned_precision`), attention on the H100s at FlashAttention-2's rate
  (`gemm.FLASH2_SHARE`: the torch of December 2024 and June 2025 ran it, not cuDNN's kernel).
  Async TP's rows are left out (plait's tensor parallelism does not overlap its collectives),
  but for the 405B's (Table 5 ran with it), priced without it.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from plait.config.schema import load_config
from plait.planner.hardware import DEVICES, ENGINES, Cluster, planned_precision
from plait.planner.pins import PINNABLE
from plait.planner.search import rank_plans
from plait.train.progress import each

MEGATRON = "Narayanan et al. 2021, Table 1"
LLAMA3 = "Llama 3 Herd, Table 4"
TITAN = "torchtitan llama3_h100_202412"
TITAN_ASYNC = "torchtitan asyncTP_llama3_h100_2025-06"
TITAN_A100 = "torchtitan performance.md, 2024-12"

# Llama 3.1's shapes (Llama Team 2024, Table 3), 8,192 tokens.
L8B = ["model.preset='70b'", "model.dim=4096", "model.n_layers=32", "model.n_heads=32",
       "model.n_kv_heads=8", "model.intermediate_size=14336", "data.seq_len=8192"]
L70B = ["model.preset='70b'", "data.seq_len=8192"]
L405B = ["model.preset='405b'", "data.seq_len=8192"]


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    model: tuple[str, ...]  # overrides
    gpus: int
    gpu: str  # a `hardware.DEVICES` key
    batch: int  # global, in sequences
    pins: dict  # the published degrees (tp, pp, cp, zero, checkpointing, ...)
    figure: tuple[str, float]  # ("tflops", per GPU) | ("mfu", share) | ("tps", tokens/s per GPU)
    # "fused" kernels (Megatron-LM's), "eager" (plait's own), "compiled" (torch.compile: its
    # fusion not modeled, priced as eager)
    engine: str = "fused"
    precision: str = "bf16"  # or "fp8"
    memory_gib: float = 0.0  # the published peak per GPU, where given
    rank: bool = False  # also rank the layout among the planner's own (a search: slow)


def _megatron(params, heads, dim, layers, tp, pp, gpus, batch, tflops) -> Published:
    model = (f"model.dim={dim}", f"model.n_layers={layers}", f"model.n_heads={heads}",
             f"model.n_kv_heads={heads}", "model.vocab_size=51200", "model.max_seq_len=2048",
             f"model.intermediate_size={round(8 * dim / 3 / 128) * 128}")
    pins = {"tp": tp, "pp": pp, "cp": 1, "zero": 0, "activation_checkpointing": "full",
            "sequence_parallel": False}  # (2021: before Korthikanti et al. 2022)
    if pp > 1:
        pins["pp_schedule"] = "interleaved"
    return Published(f"Megatron-LM {params}B", MEGATRON,
                     ("model.preset='175b'", *model, "data.seq_len=2048"), gpus, "a100", batch,
                     pins, ("tflops", tflops), rank=True)


def _titan(name, source, model, gpus, batch, pins, tps, memory, compiled, fp8=False,
           seq=8192, gpu="h100-96gb") -> Published:
    return Published(name, source, (*model, f"data.seq_len={seq}", f"model.max_seq_len={seq}"),
                     gpus, gpu, batch,
                     {"zero": 3, "cp": 1, "tp": 1, "pp": 1, "microbatches": 1,
                      "sequence_parallel": pins.get("tp", 1) > 1, **pins},  # torchtitan's TP
                     ("tps", tps), "compiled" if compiled else "eager", "fp8" if fp8 else "bf16",
                     memory)


SEL, FULL = {"activation_checkpointing": "selective"}, {"activation_checkpointing": "full"}
PUBLISHED = [
    _megatron(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    _megatron(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    _megatron(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    _megatron(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    _megatron(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _megatron(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _megatron(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _megatron(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _megatron(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
    Published("Llama 3 405B, 8K tokens", LLAMA3, tuple(L405B), 8192, "h100", 2048,
              {"tp": 8, "pp": 16, "cp": 1, "zero": 1}, ("mfu", 0.43), rank=True),
    Published("Llama 3 405B, 8K tokens", LLAMA3, tuple(L405B), 16384, "h100", 2048,
              {"tp": 8, "pp": 16, "cp": 1, "zero": 1}, ("mfu", 0.41), rank=True),
    _titan("8B FSDP", TITAN, L8B, 8, 16, SEL, 5762, 82.4, False),
    _titan("8B FSDP + compile", TITAN, L8B, 8, 16, SEL, 6667, 77.0, True),
    _titan("8B FSDP + compile + Float8", TITAN, L8B, 8, 16, SEL, 8532, 76.8, True, True),
    _titan("8B FSDP", TITAN, L8B, 128, 256, SEL, 5605, 67.0, False),
    _titan("8B FSDP + compile", TITAN, L8B, 128, 256, SEL, 6514, 62.0, True),
    _titan("8B FSDP + compile + Float8", TITAN, L8B, 128, 256, SEL, 8380, 61.8, True, True),
    _titan("8B FSDP 8, 32K tokens", TITAN, L8B, 8, 8, FULL, 3890, 83.9, True, True, 32768),
    _titan("8B FSDP 4 CP 2, 64K tokens", TITAN, L8B, 8, 4, {**FULL, "cp": 2}, 2540, 84.2, True,
           True, 65536),
    _titan("70B FSDP 32 TP 8", TITAN, L70B, 256, 512, {**FULL, "tp": 8}, 829, 71.9, True, True),
    _titan("405B FSDP 8 TP 8 PP 8, 1F1B, async TP", TITAN, L405B, 512, 256,
           {**FULL, "tp": 8, "pp": 8, "pp_schedule": "1f1b", "microbatches": 8}, 100, 82.5, True,
           True),
    _titan("405B FSDP 8 TP 8 PP 8, interleaved, async TP", TITAN, L405B, 512, 256,
           {**FULL, "tp": 8, "pp": 8, "pp_schedule": "interleaved", "microbatches": 16}, 128,
           72.7, True, True),
    _titan("70B FSDP 32 TP 8, bf16", TITAN_ASYNC, L70B, 256, 512, {**FULL, "tp": 8}, 597.3, 0,
           True),
    _titan("8B FSDP 8 TP 8, bf16", TITAN_ASYNC, L8B, 64, 96, {**SEL, "tp": 8}, 4378, 0, True),
    _titan("8B FSDP 8 TP 8, Float8", TITAN_ASYNC, L8B, 64, 96, {**SEL, "tp": 8}, 5078.1, 0, True,
           True),
    _titan("8B FSDP, A100", TITAN_A100, L8B, 64, 64, SEL, 2973, 0, False, gpu="a100"),
    _titan("70B FSDP, A100", TITAN_A100, L70B, 64, 64, FULL, 331, 0, False, gpu="a100"),
]


def _published_tokens_per_s(row: Published, cfg, peak: float, flops_per_token: float) -> float:
    kind, value = row.figure
    if kind == "tps":
        return value * row.gpus
    if kind == "mfu":
        return value * peak * row.gpus / flops_per_token
    args, s = cfg.model.args(), cfg.data.seq_len
    B, L, h, V = cfg.train.global_batch, args.n_layers, args.dim, args.vocab_size
    flops = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    return B * s / (flops / (value * 1e12 * row.gpus))


def _cluster(row: Published):
    return Cluster(row.gpus, 8, DEVICES[row.gpu], ENGINES[engine_of(row)])


def engine_of(row: Published) -> str:
    """The `plait plan --engine` a row is priced as: Megatron-LM's fused kernels (of 2021 for its
    paper's rows; with sequence parallelism and overlapped reductions for Llama 3's), or
    torchtitan's torch of 2024-2025 (whose SDPA ran FlashAttention-2)."""
    if row.engine != "fused":
        return "torchtitan"
    return "megatron-2021" if row.source == MEGATRON else "megatron"


def plan_command(row: Published) -> list[str]:
    """The `plait plan` arguments that price a row as `published_row` does (its layout pinned
    by overrides, its engine, device and cluster)."""

    key = {short: long for long, short in PINNABLE.items()}
    pins = [f"{key[k]}={v!r}" if isinstance(v, str) else f"{key[k]}={str(v).lower()}"
            for k, v in row.pins.items()]
    return ["plan", "--gpus", str(row.gpus), "--gpus-per-node", "8", "--gpu", row.gpu,
            "--engine", engine_of(row), *row.model, f"train.global_batch={row.batch}",
            f"train.precision='{row.precision}'", *pins]


def published_row(row: Published) -> dict:
    """One published run planned with its layout pinned (the micro-batches and schedule, where
    not published, the planner's best): predicted and published throughput and memory, and with
    `row.rank` where its layout ranks among the planner's distinct layouts that fit."""

    cfg = load_config(None, [*row.model, f"train.global_batch={row.batch}",
                             f"train.precision='{row.precision}'"])
    cfg, cluster = planned_precision(cfg, _cluster(row))
    plans = rank_plans(cfg, cluster, row.pins)
    if not plans:
        raise ValueError(f"{row.name}: plait cannot run its published layout {row.pins}")
    mine = plans[0]
    layout = (row.pins["tp"], row.pins["pp"], row.pins["cp"])
    ranked = None
    if row.rank:
        searched = {k: v for k, v in row.pins.items() if k not in ("tp", "pp", "cp")
                    and k != "pp_schedule"}
        best: dict[tuple, object] = {}
        for p in rank_plans(cfg, cluster, searched):
            key = (p.degrees["tp"], p.degrees["pp"], p.degrees["cp"])
            if p.fits and key not in best:
                best[key] = p
        ranked = list(best)
    tokens, peak = cfg.train.global_batch * cfg.data.seq_len, cluster.device.peak_flops
    flops_per_token = mine.mfu * row.gpus * peak * mine.step_time_s / tokens
    return {"name": row.name, "source": row.source, "params": mine.params, "gpus": row.gpus,
            "gpu": cluster.device.name, "layout": layout, "engine": row.engine,
            "engine_name": engine_of(row),
            "precision": row.precision, "fits": mine.fits,
            "rank": (ranked.index(layout) + 1 if layout in ranked else None) if ranked else None,
            "top": ranked[:3] if ranked else [], "predicted": mine.tokens_per_s,
            "published": _published_tokens_per_s(row, cfg, peak, flops_per_token),
            "memory_gib": mine.peak_memory_bytes / 2**30, "published_gib": row.memory_gib,
            "degrees": mine.degrees}


def published_rows(rank: bool = True) -> list[dict]:
    """Every published run (`rank`: with the layout searches of the rows that ask for them)."""

    rows = PUBLISHED if rank else [dataclasses.replace(r, rank=False) for r in PUBLISHED]
    return [published_row(r) for r in each(rows, "bench plan: published runs",
                                            label=lambda r: r.name)]


def errors(rows: list[dict]) -> list[float]:
    return [r["predicted"] / r["published"] - 1 for r in rows]


def _sp(row: dict) -> str:
    """Sequence parallelism as priced: "on", "off", or "-" without tp."""
    if row["layout"][0] == 1:
        return "-"
    return "on" if row["degrees"]["sequence_parallel"] else "off"


def print_published(rows: list[dict]) -> None:
    table = Table(title="plait bench plan: published runs, each layout pinned as published "
                        "(tokens/s per GPU; memory: peak GiB per GPU)")
    for col in ("run", "source", "GPUs", "tp/pp/cp", "sp", "engine", "its rank", "planner's top 3",
                "published", "predicted", "error", "GiB published", "GiB predicted"):
        table.add_column(col, justify="left" if col in ("run", "source") else "right")
    for r, e in zip(rows, errors(rows), strict=True):
        table.add_row(r["name"], r["source"], f"{r['gpus']:,} {r['gpu']}",
                      "/".join(map(str, r["layout"])), _sp(r),
                      f"{r['engine_name']}: {r['engine']} {r['precision']}",
                      str(r["rank"] or "-") if r["top"] else "-",
                      ", ".join("/".join(map(str, t)) for t in r["top"]),
                      f"{r['published'] / r['gpus']:,.0f}", f"{r['predicted'] / r['gpus']:,.0f}",
                      f"{e:+.1%}", f"{r['published_gib']:.1f}" if r["published_gib"] else "-",
                      f"{r['memory_gib']:.1f}" + ("" if r["fits"] else " (does not fit)"))
    absolute = [abs(e) for e in errors(rows)]
    table.add_row("median |error|", *[""] * 9, f"{statistics.median(absolute):.1%}", "", "",
                  style="bold")
    table.add_row("worst |error|", *[""] * 9, f"{max(absolute):.1%}", "", "", style="bold")
    Console(width=200).print(table)
