"""Resuming on another world size (an elastic restart with fewer or more workers, or a resume
with another --nproc): the data-parallel degree follows the world, the global batch is kept by
recomputing each rank's accumulation, and where the new degree does not divide the global batch,
the nearest batch it divides is used with the learning rate scaled by the linear rule (Goyal et
al. 2017). Every change is said."""

from __future__ import annotations

import dataclasses
import math

from plait.checkpoint import BadMeta, find, read_meta
from plait.config.schema import Config
from plait.mesh import AXES


def fit_world(cfg: Config, world: int) -> tuple[Config, list[str]]:
    """`cfg` adapted to `world` workers when it resumes a checkpoint made on another world size,
    and what was changed; unchanged otherwise (and when the degrees are pinned: `validate` then
    says what does not fit)."""
    source = find(cfg.checkpoint.resume, cfg.checkpoint.dir)
    if source is None:
        return cfg, []
    try:
        saved = read_meta(source)
    except BadMeta:  # the checks refuse it next, in one line (`checkpoint/checks.py`)
        return cfg, []
    if "optim" not in saved.get("contents", []):  # a model alone (an import): no run to continue
        return cfg, []
    before, par = saved.get("world_size", world), cfg.parallel
    others = math.prod(getattr(par, a) for a in AXES if a != "dp")
    if before == world or par.dp or world % others or before % others:
        return cfg, []
    old_dp, dp = before // others, world // others
    notes = [f"resuming a run of {before} workers on {world}: dp {old_dp} -> {dp}"]
    train, batch = cfg.train, cfg.train.global_batch
    if batch % dp:
        new = max(dp, batch // dp * dp)
        lr = train.lr if train.lr_scaling == "linear" else train.lr * new / batch
        notes.append(f"train.global_batch {batch} -> {new} (a multiple of dp={dp}); learning "
                     f"rate scaled linearly by {new}/{batch}")
        train = dataclasses.replace(train, global_batch=new, lr=lr)
    # Keep the micro-batch (rows per forward) of the saved run: more rows per rank, more of them.
    old_m = par.microbatches or par.pp  # config.microbatches: the pipeline's, or accumulation's
    micro_rows = max(1, batch // old_dp // old_m)
    rows = train.global_batch // dp
    m = rows // micro_rows if rows % micro_rows == 0 else math.gcd(rows, old_m)
    if m != old_m:
        notes.append(f"parallel.microbatches {old_m} -> {m} per rank, of {rows // m} sequences")
        par = dataclasses.replace(par, microbatches=m)
    return dataclasses.replace(cfg, train=train, parallel=par), notes
