"""`plait compare A.jsonl B.jsonl [--rtol R]`: two runs' losses, step by step (e.g. the same
recipe on two layouts). What the project's equivalence tests check, handed to users: the first
step whose losses differ by more than `rtol` relative is named, and the command exits 1."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


class MetricsFileError(ValueError):
    """A metrics file that cannot be read as plait's JSONL (one object per step with a loss)."""


def read_metrics(path: str) -> dict[int, dict]:
    """step -> that step's record (its loss None where the run wrote null: non-finite)."""
    file = Path(path)
    if not file.is_file():
        raise MetricsFileError(f"{path}: no such file")
    records = {}
    for number, line in enumerate(file.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record["loss"]  # noqa: B018 - every step has one
            records[int(record["step"])] = record
        except (ValueError, KeyError, TypeError):
            raise MetricsFileError(f"{path}:{number}: not a metrics line with 'step' and 'loss' "
                                   "(write one with plait train --metrics FILE)") from None
    if not records:
        raise MetricsFileError(f"{path}: no steps")
    return records


def read_losses(path: str) -> dict[int, float | None]:
    return {step: record["loss"] for step, record in read_metrics(path).items()}


@dataclass
class Comparison:
    steps: int  # compared: the steps both runs have
    first_bad: tuple[int, float | None, float | None, float] | None  # step, a, b, rel. difference
    worst: float  # largest relative difference over the compared steps
    only_in: dict[str, int]  # steps one run has and the other not, by file


def compare_losses(a: str, b: str, rtol: float) -> Comparison:
    la, lb = read_losses(a), read_losses(b)
    common = sorted(set(la) & set(lb))
    worst, first_bad = 0.0, None
    for step in common:
        x, y = la[step], lb[step]
        if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
            rel = 0.0 if x is None and y is None else math.inf
        else:
            rel = abs(x - y) / max(abs(x), abs(y), 1e-30)
        worst = max(worst, rel)
        if rel > rtol and first_bad is None:
            first_bad = (step, x, y, rel)
    return Comparison(len(common), first_bad, worst,
                      {a: len(set(la) - set(lb)), b: len(set(lb) - set(la))})
