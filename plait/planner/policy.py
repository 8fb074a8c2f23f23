"""The planner's policy: which of the ranked layouts `plait plan` offers (`choose`), and, when
none fits, the one line that says why and the smallest change that would (`_refuse`), found
from the leanest layouts (`leanest`) rather than from the whole search."""

from __future__ import annotations

from collections import Counter

from plait.config.checks_layout import check_layout
from plait.config.schema import Config, ConfigError
from plait.planner.hardware import Cluster
from plait.planner.pins import PINNABLE
from plait.planner.price import HEADROOM, PricedLayout, estimate, with_degrees
from plait.planner.search import meshes, rank_plans, refusals
from plait.planner.show import layout_text

# A layout's degrees: pinned all, the layout is the user's, priced even when it does not fit.
DEGREES = {"tp", "pp", "cp", "ep", "zero"}


def choose(cfg: Config, cluster: Cluster, fixed: dict) -> list[PricedLayout]:
    """The ranked plans. Refuses (status 2, one line) when none is valid, or when none fits
    and the degrees leave a choice, naming the cause and the smallest change that would fit;
    a layout whose degrees are all pinned (`DEGREES`) is returned even when it does not fit,
    the leanest of its variants (the caller prints it with its warning and exits 1).

    A model whose state cannot fit is refused by its bound before the search (which prices
    thousands of layouts): first by the meshes without a pipeline (a few placements, seconds
    even for a thousand layers), then by every mesh."""
    model = cfg.model.hf or cfg.model.preset
    usable = HEADROOM * cluster.device.memory_bytes
    if not DEGREES <= fixed.keys():
        quick = leanest(cfg, cluster, fixed, pipelines=False)
        if quick is not None and _state_on_device(quick) / PIPELINE_SAVES > usable:
            _refuse(cfg, cluster, fixed, quick, floor=_state_on_device(quick) / PIPELINE_SAVES)
        lean = leanest(cfg, cluster, fixed)
        if lean is not None and _state_on_device(lean) > usable:
            _refuse(cfg, cluster, fixed, lean)
    plans = rank_plans(cfg, cluster, fixed)
    if not plans:
        pins = ", ".join(f"{k}={v}" for k, v in fixed.items()) or "none pinned"
        why = refusals(cfg, cluster, fixed)
        if why:
            # The reason that refused the most layouts, of those about a pinned or unsearched
            # key first: a searched value that does not fit (4 micro-batches of 2 sequences)
            # is the search's to try, not the cause.
            own = Counter({r: n for r, n in why.items()
                           if PINNABLE.get(r.split(":")[0]) in fixed.keys() | {None}})
            (reason, n), tried = (own or why).most_common(1)[0], why.total()
            share = "every layout tried" if n == tried else f"{n} of the {tried} layouts tried"
            why = f" ({share}: {reason})"
        else:
            try:  # none tried: the settings as given, unpinned degrees at their defaults
                check_layout(cfg, cluster.gpus)
                why = ""
            except ConfigError as e:
                why = f" ({e})"
        raise ConfigError("plan", f"no layout of model '{model}' is valid on {cluster.gpus} GPUs "
                          f"with these settings ({pins}){why}; change --gpus or the pinned "
                          "degrees")
    if plans[0].fits or len(plans) == 1:
        return plans
    if DEGREES <= fixed.keys():
        # Every degree pinned: the layout is the user's; of its variants (recomputation,
        # micro-batches, offload) the leanest is priced and shown, with "does not fit".
        return [min(plans, key=lambda p: p.peak_memory_bytes)]
    need = min(p.peak_memory_bytes for p in plans) / 1e9
    lean = min(plans, key=lambda p: _state_on_device(p))
    if _state_on_device(lean) > usable:  # the model state alone, before any activation
        _refuse(cfg, cluster, fixed, lean)
    _refuse(cfg, cluster, fixed, lean, f"the leanest layout needs {need:.1f} GB per GPU",
            "lower train.global_batch or data.seq_len")


# A pipeline splits the embedding from the head and the layers over stages: under ZeRO-3 it
# leaves a rank at least this fraction of the model state of the same mesh without one (27% less
# at most on the presets; tests/unit/test_plan.py checks every preset against the bound).
PIPELINE_SAVES = 2


def _refuse(cfg: Config, cluster: Cluster, fixed: dict, lean: PricedLayout, cause: str = "",
            change: str = "use more GPUs or GPUs with more memory", floor: float = 0.0) -> None:
    """Raise the one line: why nothing fits (by default: the model state of `lean`, the plan
    with the least of it; `floor`: a bound below the least model state per GPU, where `lean`
    is not the leanest), and the smallest cluster (2, 4 or 8 times the GPUs) on which
    something does. A cluster k times larger divides the model state per GPU by k at most (the
    slices; what is gathered whole stays), so one where even that cannot fit is not searched."""
    usable = HEADROOM * cluster.device.memory_bytes
    state = _state_on_device(lean)
    floor = floor or state
    cause = cause or (f"its model state alone needs {'over ' if floor < state else ''}"
                      f"{floor / 1e9:.1f} GB per GPU at best (ZeRO-{lean.degrees['zero']}"
                      + (f", {lean.degrees['offload']} offload"
                         if lean.degrees["offload"] != "none" else "") + ")")
    for factor in (2, 4, 8):
        if floor / factor > usable:
            continue
        more = Cluster(cluster.gpus * factor, cluster.gpus_per_node, cluster.device,
                       cluster.engine)
        least = leanest(cfg, more, fixed)
        if least is not None and _state_on_device(least) > usable:
            continue
        found = rank_plans(cfg, more, fixed)
        if found and found[0].fits:
            change = f"use {more.gpus} GPUs (then {layout_text(found[0])})"
            break
    model = cfg.model.hf or cfg.model.preset
    raise ConfigError("plan", f"model '{model}' does not fit on {cluster.gpus} x "
                      f"{cluster.device.name}: {cause} of "
                      f"{cluster.device.memory_bytes / 1e9:.0f} GB; smallest change: {change}")


def leanest(cfg: Config, cluster: Cluster, fixed: dict,
            pipelines: bool = True) -> PricedLayout | None:
    """Of every mesh the search would try, each at its leanest (ZeRO-3, offload on a GPU, one
    micro-batch per stage, full recomputation), the plan with the least model state on a
    device: a few layouts priced instead of thousands. `pipelines=False`: only the widest valid
    tp without a pipeline, at its leanest offload (tp splits every block, and offloading the
    parameters leaves the least on the device): a placement or two, within `PIPELINE_SAVES` of
    the leanest. None when no such layout is valid (the search then says why)."""
    offloads = ["params", "optimizer", "none"] if not cluster.device.name.startswith("cpu") \
        else ["none"]
    found = list(meshes(cfg, cluster, fixed))
    if not pipelines:
        found.sort(key=lambda m: (-m[0], m[1]))  # widest tp first, then the shallowest pipeline
    best, seen = None, set()
    for tp, pp, cp, ep, _ in found:
        if not pipelines and ((tp, cp, ep) in seen or best and tp < best.degrees["tp"]):
            continue
        for offload in offloads:
            d = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "zero": 3, "offload": offload,
                 "sequence_parallel": tp > 1, "pp_schedule": "1f1b", "microbatches": pp,
                 "dp_shard": 0, "activation_checkpointing": "full", **fixed, "dp": 0}
            c = with_degrees(cfg, **d)  # dp: the mesh's (a pinned dp chose the meshes)
            try:
                dims = check_layout(c, cluster.gpus)
            except ConfigError:
                continue
            seen.add((tp, cp, ep))
            plan = estimate(c, dims, cluster)
            if best is None or _state_on_device(plan) < _state_on_device(best):
                best = plan
            if not pipelines:
                break
    return best


def _state_on_device(p: PricedLayout) -> float:
    """A plan's device bytes less its activations (its model state at its peak, or at start-up)."""
    return p.peak_memory_bytes - p.memory_bytes["activations"]
