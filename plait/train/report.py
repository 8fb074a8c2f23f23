"""Pictures of a run. `plait report METRICS [--out DIR]` draws a metrics file (plait train
--metrics) as PNGs, one per question:

    loss.png         train and validation loss, against steps and against tokens
    throughput.png   tokens/s and MFU per step
    comm.png         bytes this rank's training collectives moved per step, and how many calls
    memory.png       model-state bytes per rank (params, grads, optimizer, compression state) and
                     the peak bytes saved for backward, per step

A figure whose metrics the file lacks is left out and said so. The pipeline timeline (one row per
stage, a bar per F / B / W action) is drawn here too, for `plait bench pp` and `plait train
--trace` alike, from the trace's pipeline events.
"""

from __future__ import annotations

import math
from pathlib import Path

from plait.train.compare import MetricsFileError, read_metrics

MiB = 2**20


def _pyplot():
    # here, not at the top: matplotlib only where a picture is drawn
    import matplotlib

    matplotlib.use("Agg")
    # here, not at the top: matplotlib only where a picture is drawn
    import matplotlib.pyplot as plt

    return plt


def find_metrics(path: str) -> Path:
    """A metrics file, or the run folder holding one (metrics.jsonl, else its only *.jsonl)."""
    target = Path(path)
    if target.is_dir():
        if (target / "metrics.jsonl").is_file():
            return target / "metrics.jsonl"
        found = sorted(target.glob("*.jsonl"))
        if len(found) != 1:
            raise MetricsFileError(f"{path}: a folder with {len(found)} *.jsonl files; name the "
                                   "metrics file itself")
        return found[0]
    return target


def _series(records: dict[int, dict], key: str, sub: str | None = None):
    """(steps, values) where the record has a finite number under key (or key/sub)."""
    steps, values = [], []
    for step, record in sorted(records.items()):
        value = record.get(key)
        if sub is not None:
            value = value.get(sub) if isinstance(value, dict) else None
        if isinstance(value, int | float) and math.isfinite(value):
            steps.append(step)
            values.append(value)
    return steps, values


def _save(fig, out: Path, name: str) -> Path:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    _pyplot().close(fig)
    return out / name


def write_report(metrics: str, out: str | None = None) -> tuple[list[Path], list[str]]:
    """The PNGs written and, for each figure left out, why."""
    path = find_metrics(metrics)
    records = read_metrics(str(path))
    folder = Path(out) if out else path.parent / "report"
    folder.mkdir(parents=True, exist_ok=True)
    plt, written, missing = _pyplot(), [], []
    tokens = dict(zip(*_series(records, "tokens"), strict=True))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, per_token in zip(axes, (False, True), strict=True):
        for key, style in (("loss", "-"), ("val_loss", "o-")):
            steps, values = _series(records, key)
            if per_token:
                pairs = [(tokens[s], v) for s, v in zip(steps, values, strict=True) if s in tokens]
                steps, values = [p[0] for p in pairs], [p[1] for p in pairs]
            if steps:
                ax.plot(steps, values, style, label=key.replace("_", " "), markersize=4)
        ax.set_xlabel("tokens" if per_token else "step")
        ax.set_ylabel("loss")
        if ax.lines:  # metrics without `tokens` leave the per-token panel empty
            ax.legend()
        ax.grid(alpha=0.3)
    written.append(_save(fig, folder, "loss.png"))

    panels = {
        "throughput.png": [("tokens_per_s", None, "tokens/s", 1), ("mfu", None, "MFU", 1)],
        "comm.png": [("comm_bytes", None, "MiB moved per step (rank 0)", MiB),
                     ("comm_calls", "*", "collective calls per step", 1)],
        "memory.png": [("model_state_bytes", "*", "model-state MiB per rank", MiB),
                       ("activation_bytes", None, "peak activation MiB (rank 0)", MiB)],
    }
    for name, rows in panels.items():
        fig, axes = plt.subplots(1, len(rows), figsize=(11, 4))
        drawn = 0
        for ax, (key, sub, label, unit) in zip(axes, rows, strict=True):
            subs = [sub] if sub != "*" else sorted({k for r in records.values()
                                                    for k in (r.get(key) or {})})
            for part in subs:
                steps, values = _series(records, key, part)
                if steps:
                    ax.plot(steps, [v / unit for v in values], label=part or key)
                    drawn += 1
            ax.set_xlabel("step")
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)  # flat lines read as flat, not as noise
            ax.grid(alpha=0.3)
            if sub == "*" and subs:
                ax.legend()
        if drawn:
            written.append(_save(fig, folder, name))
        else:
            plt.close(fig)
            missing.append(f"{name}: the file has no {' or '.join(r[0] for r in rows)}")
    return written, missing


def draw_losses(runs: list[str], path: str | Path) -> Path:
    """Several runs' train loss (a line each) and validation loss (dots) against the step, in
    one picture, each labelled by its file's name: `plait compare A B --png`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in runs:
        records = read_metrics(run)
        line = ax.plot(*_series(records, "loss"), lw=1, alpha=0.8,
                       label=f"{Path(run).stem} train")[0]
        steps, values = _series(records, "val_loss")
        if steps:
            ax.plot(steps, values, "o-", color=line.get_color(), markersize=4,
                    label=f"{Path(run).stem} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out.parent, out.name)


def draw_timelines(results: dict[str, list[list[tuple]]], path: str | Path) -> None:
    """One panel per entry (a schedule, or a traced step), one row per stage, a bar per action;
    each stage's spans are (kind, micro-batch, chunk, start s, end s)."""
    plt = _pyplot()
    colors = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452"}
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.2 + 0.9 * len(results) *
                             len(next(iter(results.values())))), squeeze=False)
    for ax, (name, stage_spans) in zip(axes[:, 0], results.items(), strict=True):
        begin = min(s[3] for spans in stage_spans for s in spans)
        for stage, spans in enumerate(stage_spans):
            for kind, mb, chunk, start, end in spans:
                # Interleaved: a stage's later chunks drawn lighter.
                alpha = 1.0 if chunk < len(stage_spans) else 0.6
                ax.broken_barh([((start - begin) * 1e3, (end - start) * 1e3)],
                               (stage - 0.4, 0.8), facecolors=colors[kind], edgecolor="white",
                               alpha=alpha)
                ax.text((start + end - 2 * begin) / 2 * 1e3, stage, f"{kind}{mb}",
                        ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(range(len(stage_spans)), [f"stage {s}" for s in range(len(stage_spans))])
        ax.invert_yaxis()
        ax.set_title(f"{name}: measured timeline", fontsize=9)
        ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
