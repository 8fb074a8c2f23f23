"""`plait bench gemm`: a device's achieved matrix-multiply rate by shape, beside what the
planner's shape model (`plait.planner.gemm`) predicts for it.

A training step's matmuls are those of its linear layers: forward (tokens x in) @ (in x out),
and backward's two, the input gradient (tokens x out) @ (out x in) and the weight gradient
(in x tokens) @ (tokens x out), whose inner dimension is the tokens. Tensor parallelism divides
`in` or `out` by tp; a micro-batch fixes the tokens. The sweep crosses those three sizes, in
bf16 (and in fp8 with `--fp8`, through `torch._scaled_mm`, on devices that have it). Each shape:
three warm-up products, then the mean of `repeats` timed by CUDA events (by the clock on a CPU).
Operands are random normal: zeros make the tensor cores draw less power and run faster.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from plait.planner.gemm import gemm_seconds
from plait.planner.hardware import known_device

TOKENS = (1024, 4096, 16384)
WIDTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
CPU_WIDTHS = (64, 128, 256, 512, 1024)  # a CPU core needs seconds beyond these


def shapes(device: torch.device) -> list[tuple[int, int, int]]:
    """(m, n, k) to measure: tokens x each pair of widths (a GPU), small squares and thin ones
    (a CPU)."""
    if device.type == "cpu":
        return [(m, n, k) for m, n, k in itertools.product((256, 1024), CPU_WIDTHS, CPU_WIDTHS)]
    return [(m, n, k) for m, n, k in itertools.product(TOKENS, WIDTHS, WIDTHS)
            if m * max(n, k) * 2 <= 2**30]  # each operand at most 1 GiB in bf16


def _operands(m: int, n: int, k: int, device, fp8: bool):
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    if not fp8:
        return lambda: a @ b.t()
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                    out_dtype=torch.bfloat16)


def _seconds(run, device: torch.device, repeats: int) -> float:
    for _ in range(3):
        run()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        return (time.perf_counter() - start) / repeats
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    begin.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / 1e3 / repeats


def measure(device: torch.device, fp8: bool = False, repeats: int = 10) -> list[dict]:
    """Each shape's achieved FLOP/s (2 m n k per product), bf16 and, with `fp8`, fp8."""
    rows = []
    for kind in ("bf16", "fp8") if fp8 else ("bf16",):
        for m, n, k in shapes(device):
            seconds = _seconds(_operands(m, n, k, device, kind == "fp8"), device, repeats)
            rows.append({"dtype": kind, "m": m, "n": n, "k": k, "seconds": seconds,
                         "flops": 2 * m * n * k / seconds})
    return rows


def _attention_case(seq: int, device: torch.device):
    """(forward, forward + backward) callables of causal attention over `seq` tokens."""
    q, k, v = (torch.randn(1, 32, seq, 128, device=device, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 32, seq, 128, device=device, dtype=torch.bfloat16)

    def forward():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both():
        torch.autograd.grad(forward(), (q, k, v), grad)

    return forward, both


def attention(device: torch.device, repeats: int = 10) -> list[dict]:
    """Causal scaled-dot-product attention (torch's fused kernel) of 32 heads of 128, forward and
    forward + backward, at 2K and 8K tokens: FLOPs 2 s^2 d per head forward (the scores and the
    weighted sum, half of 4 s^2 d under the causal mask), twice that backward."""
    rows = []
    for seq in (2048, 8192):
        forward, both = _attention_case(seq, device)
        flops = 2 * 32 * seq * seq * 128
        for name, run, counted in (("forward", forward, flops),
                                   ("forward+backward", both, 3 * flops)):
            seconds = _seconds(run, device, repeats)
            rows.append({"pass": name, "seq": seq, "seconds": seconds,
                         "flops": counted / seconds})
    return rows


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read and written per second by a 1 GiB device-to-device copy."""
    src = torch.empty(2**29, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / _seconds(lambda: dst.copy_(src), device, 10)


def run_gemm(out: str, fp8: bool = False, device: str | None = None, repeats: int = 10) -> dict:
    """`plait bench gemm`: the sweep on this machine's device (a GPU when there is one), written
    to `out` as JSON and printed beside the planner's shape model (GPUs it knows by name); each
    case timed over `repeats` products after three warm-up ones."""

    device_ = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = torch.cuda.get_device_name(device_) if device_.type == "cuda" else "cpu"
    found = {"device": name, "torch": torch.__version__,
             "rows": measure(device_, fp8, repeats)}
    if device_.type == "cuda":
        found["attention"] = attention(device_, repeats)
        found["copy_bytes_per_s"] = copy_bandwidth(device_)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(found, indent=1))
    print_gemm(found)
    return found


def _error(row: dict, model) -> float:
    predicted = gemm_seconds(row["m"], row["n"], row["k"], model, row["dtype"] == "fp8")
    return abs(predicted / row["seconds"] - 1)


def print_gemm(found: dict) -> None:
    """Per dtype and token count: the measured TFLOP/s at the narrowest, middle and widest
    products, and the shape model's median error where the planner knows the device."""

    model = known_device(found["device"]) if found["device"] != "cpu" else None
    table = Table(title=f"plait bench gemm: {found['device']} (torch {found['torch']}), "
                        "TFLOP/s by shape (m tokens x n x k)"
                        + (f"; model: {model.name}" if model else ""))
    for col in ("dtype", "m", "shapes", "smallest n = k", "largest n = k", "best",
                "model median |error|"):
        table.add_column(col, justify="right")
    groups: dict[tuple, list[dict]] = {}
    for r in found["rows"]:
        groups.setdefault((r["dtype"], r["m"]), []).append(r)
    for (dtype, m), rows in groups.items():
        square = sorted((r for r in rows if r["n"] == r["k"]), key=lambda r: r["n"])
        error = "-"
        if model is not None:
            error = f"{statistics.median(_error(r, model) for r in rows):.1%}"
        table.add_row(dtype, f"{m:,}", str(len(rows)),
                      f"{square[0]['flops'] / 1e12:,.1f} at {square[0]['n']:,}",
                      f"{square[-1]['flops'] / 1e12:,.1f} at {square[-1]['n']:,}",
                      f"{max(r['flops'] for r in rows) / 1e12:,.1f}", error)
    Console(width=140).print(table)
    for a in found.get("attention", []):
        print(f"attention {a['pass']} at {a['seq']:,} tokens: {a['flops'] / 1e12:,.0f} TFLOP/s")
    if "copy_bytes_per_s" in found:
        print(f"device-to-device copy: {found['copy_bytes_per_s'] / 1e12:.2f} TB/s")


def main(argv: list[str] | None = None) -> None:
    """`python -m plait.bench.gemm --out FILE [--fp8]`: the bench on a machine where plait's
    command line is not installed (a GPU machine with its own torch)."""

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--device")
    args = parser.parse_args(argv)
    run_gemm(args.out, args.fp8, args.device)


if __name__ == "__main__":
    main()
