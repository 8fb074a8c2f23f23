"""Live progress on rank 0: a rich progress bar on a terminal, a plain log line otherwise (CI logs,
pipes), for training and for every long command (`each`); and the end-of-run summary table."""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress
from rich.table import Table


def each(items: list, what: str, enabled: bool = True, label=str):
    """Yield the items of a long command (a bench suite's runs) under a progress bar on a
    terminal, a line per item otherwise (`label(item)` names it); silent when not enabled
    (ranks other than 0)."""
    console = Console(stderr=True)
    if not enabled:
        yield from items
    elif console.is_terminal:
        with RichProgress(TextColumn(f"[bold]{what}"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("{task.description}"), TimeElapsedColumn(),
                          console=console, transient=True) as bar:
            task = bar.add_task("", total=len(items))
            for item in items:
                bar.update(task, description=label(item))
                yield item
                bar.advance(task)
    else:
        for i, item in enumerate(items, 1):
            console.print(f"{what} {i}/{len(items)}: {label(item)}", highlight=False)
            yield item


class Progress:
    def __init__(self, steps: int, enabled: bool, start: int = 0):
        self.steps, self.enabled = steps, enabled
        self.console = Console(stderr=True)
        self.live = enabled and self.console.is_terminal
        self.log_every = max(1, steps // 10)
        self._bar = None
        if self.live:
            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._bar.add_task("train", total=steps, completed=start,
                                            loss=float("nan"), tps=0.0)
            self._bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float, val_loss: float | None) -> None:
        if not self.enabled:
            return
        if self.live:
            self._bar.update(self._task, completed=step + 1, loss=loss, tps=tokens_per_s)
        if val_loss is not None or not self.live and (
            step % self.log_every == 0 or step + 1 == self.steps
        ):
            val = f"  val_loss {val_loss:.4f}" if val_loss is not None else ""
            self.console.print(
                f"step {step + 1:>5}/{self.steps}  loss {loss:.4f}{val}  {tokens_per_s:,.0f} tok/s",
                highlight=False,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def print_summary(summary, world_size: int) -> None:
    """The end-of-run table (rank 0)."""
    state = summary.model_state_bytes
    table = Table(title=f"plait train: {world_size} rank(s)", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("final train loss", f"{summary.losses[-1]:.4f}"),
        ("first train loss", f"{summary.losses[0]:.4f}"),
        ("validation loss", f"{summary.val_loss:.4f}"),
        ("tokens/s (median step)", f"{summary.tokens_per_s:,.0f}"),
        ("MFU", f"{summary.mfu:.1%}"),
        ("communicated per step, rank 0", _bytes(summary.comm_bytes_per_step)),
        ("params per rank", _bytes(state["params"])),
        ("grads per rank", _bytes(state["grads"])),
        ("optimizer state per rank", _bytes(state["optimizer"])),
        ("model state at its peak in a step", _bytes(state["peak"])),
        ("peak memory predicted (state + activations)", _bytes(summary.mem_predicted_peak)),
    ]
    if summary.gpu_mem_allocated_peak is not None:  # the device's own count, rank 0
        rows += [("GPU memory allocated at its peak", _bytes(summary.gpu_mem_allocated_peak)),
                 ("GPU memory reserved at its peak", _bytes(summary.gpu_mem_reserved_peak))]
    if "compression" in state:  # error feedback, PowerSGD's Q
        rows.append(("compression state per rank", _bytes(state["compression"])))
    if summary.moe:  # mixture of experts: over the run's steps
        def mean(key):
            return statistics.fmean(m[key] for m in summary.moe)

        rows += [("MoE load-balancing loss (mean)", f"{mean('aux_loss'):.4f}"),
                 ("MoE tokens dropped (mean)", f"{mean('dropped'):.2%}"),
                 ("MoE busiest expert / mean (worst)",
                  f"{max(m['max_load'] for m in summary.moe):.2f}")]
    if summary.loss_scale:
        rows.append(("fp16 loss scale (end)", f"{summary.loss_scale:g}"))
    if summary.skipped_steps:
        why = "fp16 overflow" if summary.loss_scale else "non-finite gradient"
        rows.append((f"steps skipped ({why})", str(summary.skipped_steps)))
    for row in rows:
        table.add_row(*row)
    Console(stderr=True).print(table)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1024
    return ""
