"""`plait bench compression --nproc N [--config FILE] [overrides]`: one recipe (the default: the
`make demo` run) trained once per gradient-compression method, from the same weights and data,
and twice more under PyTorch's DDP communication hooks as the peers:

    plait     none, fp16, bf16, int8, topk, powersgd, sign     (the trainer's own fit)
    torch     DDP + fp16_compress_hook, DDP + powerSGD_hook     (one bucket: on gloo, PowerSGD
              with several buckets aborts, its collectives issued in a different order per rank)

Reported per run: final train loss (mean of the last 10 steps: one step's loss is noisy), final
validation loss, their gap to uncompressed, bytes per step per rank (plait's ledger; the hooks'
traffic is torch's own and not accounted) and their ratio to uncompressed, median step time; the
loss curves in one PNG.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from plait.bench.step import start_worker, with_free_dp
from plait.bench.text import size_text
from plait.config.schema import Config, microbatches
from plait.data.batches import TokenData
from plait.launch import launch
from plait.model import build_model
from plait.optim.build import build_optimizer, lr_at, set_lr
from plait.train.checks import validate
from plait.train.progress import each
from plait.train.trainer import Trainer

PEERS = ("torch fp16_compress_hook", "torch powerSGD_hook")
TAIL = 10  # steps averaged into the final train loss


def with_method(cfg: Config, method: str) -> Config:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                 compression=method))


@record
def bench_plait(cfg: Config) -> dict | None:
    """The trainer's own fit, with cfg's compression method."""
    dims, mesh = start_worker(cfg)
    summary = Trainer(cfg, dims, mesh, torch.device("cpu")).fit()
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank:
        return None
    return {"losses": summary.losses, "val_loss": summary.val_loss,
            "bytes": summary.comm_bytes_per_step,
            "step_s": cfg.train.global_batch * cfg.data.seq_len / summary.tokens_per_s}


@record
def bench_torch_hook(cfg: Config, peer: str) -> dict | None:
    """The same recipe under torch DDP with a communication hook: the same model, data, AdamW
    groups, LR schedule and clipping as plait's trainer, written as the plain loop a torch user
    would write around DDP (the hook needs DDP's own forward)."""
    dims, mesh = start_worker(cfg)
    group, train = mesh["dp"].get_group(), cfg.train
    model = build_model(cfg.model.args(), train.seed)
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=1024)  # one bucket
    if peer == PEERS[0]:
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    else:
        state = powerSGD_hook.PowerSGDState(
            group, matrix_approximation_rank=cfg.parallel.compression_rank,
            start_powerSGD_iter=max(2, cfg.parallel.compression_start))
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    params = list(model.parameters())
    opt = build_optimizer([p for p in params if p.dim() >= 2],
                          [p for p in params if p.dim() < 2], train)
    data, rank, n = TokenData(cfg.data, train.seed), mesh["dp"].get_local_rank(), dims.dp
    m = microbatches(cfg.parallel, dims)

    def mean_loss(x, y) -> float:
        t = torch.tensor([F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).item()])
        dist.all_reduce(t, group=group)
        return t.item() / n

    losses, times = [], []
    for step in range(train.steps):
        start = time.perf_counter()
        set_lr(opt, lr_at(step, train))
        opt.zero_grad(set_to_none=True)
        x, y = data.batch(step, train.global_batch, rank, n)
        total = 0.0
        for i, (xs, ys) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
            with ddp.no_sync() if i < m - 1 else torch.enable_grad():
                loss = F.cross_entropy(ddp(xs).flatten(0, 1), ys.flatten()) / m
                loss.backward()
            total += loss.item()
        if train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, train.grad_clip)
        opt.step()
        times.append(time.perf_counter() - start)
        t = torch.tensor([total])
        dist.all_reduce(t, group=group)
        losses.append(t.item() / n)
    with torch.no_grad():
        ddp.eval()
        val = [mean_loss(*data.val_batch(i, train.global_batch, rank, n))
               for i in range(train.eval_batches)]
    dist.destroy_process_group()
    if rank:
        return None
    return {"losses": losses, "val_loss": sum(val) / len(val), "bytes": None,
            "step_s": statistics.median(times[1:] or times)}


def final_loss(losses: list[float]) -> float:
    return statistics.mean(losses[-TAIL:])


def draw_curves(runs: dict[str, dict], png: str) -> None:
    # here, not at the top: matplotlib only where a picture is drawn
    import matplotlib

    matplotlib.use("Agg")
    # here, not at the top: matplotlib only where a picture is drawn
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, run in runs.items():
        style = "--" if name in PEERS else "-"
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], style, lw=1, label=name)
    ax.set(xlabel="step", ylabel="train loss", yscale="log",
           title="plait bench compression: loss per step by method")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def run_compression(nproc: int, cfg: Config, methods: list[str], png: str) -> list[dict]:
    """Each method on the same recipe, then torch's hooks: the workers above."""
    cfg = with_free_dp(cfg)
    for method in methods:
        validate(with_method(cfg, method), nproc)
    runs = {}
    for name in each([*methods, *PEERS], "bench compression: training with"):
        if name in PEERS:
            runs[name] = launch(nproc, bench_torch_hook, cfg, name, threads=cfg.train.threads)[0]
        else:
            runs[name] = launch(nproc, bench_plait, with_method(cfg, name),
                                threads=cfg.train.threads)[0]
    base = runs.get("none")
    args, par = cfg.model.args(), cfg.parallel
    table = Table(title=(
        f"plait bench compression: {nproc} ranks, model dim {args.dim} x {args.n_layers} layers, "
        f"{cfg.train.steps} steps of {cfg.train.global_batch} x {cfg.data.seq_len} tokens; topk "
        f"ratio {par.compression_ratio}, PowerSGD rank {par.compression_rank}, start "
        f"{par.compression_start}; train loss: mean of the last 10 steps"))
    for col in ("method", "train loss", "val loss", "val gap", "bytes/step", "bytes ratio",
                "step (ms)"):
        table.add_column(col, justify="left" if col == "method" else "right")
    rows = []
    for name, run in runs.items():
        row = {"method": name, "train_loss": final_loss(run["losses"]),
               "val_loss": run["val_loss"], "bytes": run["bytes"], "step_s": run["step_s"]}
        row["val_gap"] = run["val_loss"] / base["val_loss"] - 1 if base else None
        row["bytes_ratio"] = run["bytes"] / base["bytes"] if base and run["bytes"] else None
        rows.append(row)
        table.add_row(name, f"{row['train_loss']:.4f}", f"{row['val_loss']:.4f}",
                      f"{row['val_gap']:+.1%}" if row["val_gap"] is not None else "-",
                      size_text(int(run["bytes"])) if run["bytes"] is not None else "-",
                      f"{row['bytes_ratio']:.3f}" if row["bytes_ratio"] is not None else "-",
                      f"{run['step_s'] * 1e3:,.1f}")
    Console(width=140).print(table)
    draw_curves(runs, png)
    Console().print(f"loss curves: {png}")
    return rows


__all__ = ["PEERS", "bench_plait", "bench_torch_hook", "draw_curves", "final_loss",
           "run_compression", "with_method"]
