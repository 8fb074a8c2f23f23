"""`plait train --dry-run`: what every rank of a configuration would hold and communicate, without
starting a process.

For each rank coordinate, the straight line of `parallelize` runs on a `meta` model with dry axes
(`plait.parallel.place`: the same transforms, no communication), and the formulas of
`plait.predict.cost`, which the composition matrix asserts equal to real runs, give the
model-state bytes and the collectives of one training step, per group;
the rank's step run on fake tensors (`plait.predict.trace`) the peak bytes kept for backward and
its FLOPs, measured on the model itself, whichever it is.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from plait.config.schema import Config, microbatches
from plait.mesh import (
    AXES,
    TP_ACROSS,
    Axis,
    ParallelDims,
    across_nodes,
    batch_axis,
    node_layout,
    ranks_per_node,
)
from plait.parallel import place
from plait.predict import cost
from plait.predict.activations import activation_bytes
from plait.predict.trace import Untraceable, trace_class


def describe_rank(cfg: Config, dims: ParallelDims, rank: int) -> dict:
    coords = dims.coords(rank)
    axes = {a: Axis.dry(a, coords[a], getattr(dims, a)) for a in AXES}
    axes["batch"] = batch_axis(axes)
    model = cfg.model.build(cfg.train.seed, "meta")
    chunks, _, record = place(model, axes, cfg.parallel, microbatches(cfg.parallel, dims),
                              cfg.train.activation_checkpointing)
    layouts = cost.chunk_layouts(chunks)
    try:
        traced = trace_class(cfg, dims, rank)
        activations, flops, untraced = traced.activation_bytes, traced.flops, None
    except Untraceable as e:  # said; a formula only where plait's own Llama has one
        activations = None if cfg.model.hf else activation_bytes(cfg, dims, layouts)
        flops, untraced = None, str(e) + ("" if cfg.model.hf else
                                          "; activations by plait's Llama formula")
    return {
        "rank": rank,
        "coords": coords,
        "chunks": sorted(int(c) for c in chunks),
        "tensors": len(record.params),
        "elements": record.held_numel(),
        "state": cost.state_bytes(cfg, dims, record),
        "startup": cost.startup_bytes(cfg, dims, record),
        "activations": activations,
        "flops": flops,
        "newton_schulz_flops": cost.muon_flops(cfg, dims, record),  # Muon's optimizer step
        "untraced": untraced,
        "traffic": cost.step_traffic(cfg, dims, record, layouts),
    }


def _mib(n) -> str:
    return f"{float(n) / 2**20:,.3f}"


def print_dry_run(cfg: Config, dims: ParallelDims) -> list[dict]:
    ranks = [describe_rank(cfg, dims, r) for r in range(dims.world_size)]
    shown = [a for a in AXES if getattr(dims, a) > 1] or ["dp"]
    degrees = " x ".join(f"{a}{getattr(dims, a)}" for a in AXES if getattr(dims, a) > 1)
    console = Console(width=160)
    state = Table(title=f"plait train --dry-run: {dims.world_size} rank(s) ({degrees or 'one'}), "
                        f"zero {cfg.parallel.zero}, {cfg.train.precision}; model state per rank")
    kinds = list(ranks[0]["state"])  # params, grads, optimizer (, compression)
    for col in ("rank", *shown, "chunks", "tensors", "parameters", *(f"{k} MiB" for k in kinds),
                "activations MiB", "GFLOP", "start-up MiB"):
        state.add_column(col, justify="right")
    for r in ranks:
        state.add_row(str(r["rank"]), *(str(r["coords"][a]) for a in shown),
                      ",".join(map(str, r["chunks"])), str(r["tensors"]),
                      f"{r['elements']:,}", *(_mib(r["state"][k]) for k in kinds),
                      "not traced" if r["activations"] is None else _mib(r["activations"]),
                      "not traced" if r["flops"] is None else
                      f"{(r['flops'] + r['newton_schulz_flops']) / 1e9:,.3f}",
                      _mib(r["startup"]))
    console.print(state)
    node = ranks_per_node(cfg.parallel.ranks_per_node, dims.world_size)
    nodes = dims.world_size // node
    console.print(f"{nodes} node(s) of {node} ranks (parallel.ranks_per_node, else the launcher's "
                  "LOCAL_WORLD_SIZE; a node's processes get consecutive ranks): "
                  + ", ".join(f"node {i}: ranks {i * node}-{(i + 1) * node - 1}"
                              for i in range(min(nodes, 4))) + (", ..." if nodes > 4 else "")
                  + f"; {node_layout(dims, node)}")
    if "tp" in across_nodes(dims, node):
        console.print(f"warning: {TP_ACROSS}")
    comm = Table(title="collectives of one training step, per rank and group "
                       "(bytes by the ring convention)")
    for col in ("rank", "group", "collective", "count", "MiB"):
        comm.add_column(col, justify="left" if col in ("group", "collective") else "right")
    for r in ranks:
        for group, ops in sorted(r["traffic"].groups.items()):
            for op, (count, moved) in ops.items():
                comm.add_row(str(r["rank"]), group, op.value, str(count), _mib(moved))
        comm.add_row(str(r["rank"]), "all", "total", "", _mib(r["traffic"].total),
                     end_section=True)
    console.print(comm)
    if cfg.train.optimizer == "muon":
        console.print("Muon: GFLOP includes each rank's Newton-Schulz iterations on the matrices "
                      "it owns (" + ", ".join(f"rank {r['rank']}: "
                                               f"{r['newton_schulz_flops'] / 1e9:,.3f}"
                                               for r in ranks[:8]) + "); its all-to-alls are "
                      "above")
    untraced = next((r["untraced"] for r in ranks if r["untraced"]), None)
    if untraced:
        console.print(f"activations not traced: {untraced}")
    if cfg.model.args().moe_experts:
        console.print("mixture of experts: the tokens' all-to-alls depend on the routing and are "
                      "not above (each step's comm_bytes has them)")
    return ranks
