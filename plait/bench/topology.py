"""`plait bench topology`: the planner's topology rules, measured on 2 emulated nodes of 2
processes (`plait/nodes.py`) and predicted by `plait plan`'s model of that cluster.

The cluster is calibrated first, per link kind, by all-reduces of 4 KiB to 16 MiB timed in it
(`links`): the two processes of each node (their namespace's loopback: the intra-node link; both
nodes at once, as in a step, since the emulated nodes share this machine's cores), and one
process on each node across the shaped link (the inter-node link), each fitted to alpha-beta as
`plait plan --calibrate` fits loopback. The inter-node link is shaped to loopback's measured
bandwidth over each ratio of `RATIOS` (NVLink : InfiniBand ~18, NVLink : Ethernet ~75, from the
field's bandwidth table). The node's one link is shared by the groups crossing it at once
(`Device.node_link`), which a third measurement shows: both pairs across at once. Compute is the
machine's calibration (`plait plan --calibrate`; run first when missing).

Each layout of `LAYOUTS` then trains the 'small' preset (4 heads; 8 x 128 tokens) as a torchrun
job across the nodes: rank 0's median step time and time blocked in collectives after two
warm-up steps, against the plan's step time and exposed communication for the same
configuration on that cluster.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from plait.bench.calibrate import calibrate
from plait.comm import all_reduce
from plait.config.schema import load_config
from plait.mesh import node_layout
from plait.nodes import EmulatedNodes
from plait.planner.calibrate import fit_alpha_beta, load
from plait.planner.hardware import Cluster, cpu_device
from plait.planner.price import estimate
from plait.train.checks import validate
from plait.train.progress import each

NODES, PER_NODE = 2, 2
RATIOS = (18, 75)  # loopback's bandwidth over the inter-node link's
# Bytes per all-reduce when calibrating: loopback is ~100x faster than the shaped link.
SIZES = {"intra": [2**14, 2**16, 2**18, 2**20, 2**22, 2**24],
         "inter": [2**12, 2**14, 2**16, 2**18, 2**20, 2**22]}
# The 'small' preset with 4 heads of 48 and 4 key/value heads (its 6 and 2 do not split 4 ways).
BASE = ["model.preset='small'", "model.n_heads=4", "model.n_kv_heads=4",
        "train.global_batch=8", "data.seq_len=128",
        "train.eval_batches=1", "train.warmup_steps=1", "train.peak_tflops=1.0"]
WARMUP = 2  # steps left out of the medians
# (what else the layout says, overrides). Ranks fill nodes in order and tp is the mesh's innermost
# axis, so on nodes of 2, tp2 stays inside them and tp4 spans both; a row's `layout` is the
# mesh's own account of it (`mesh.node_layout`: "tp2 inside nodes x dp2 across").
LAYOUTS = [
    ("", ["parallel.tp=2"]),
    ("", ["parallel.tp=4"]),
    ("ring all-reduce", ["parallel.allreduce='ring'"]),
    ("hierarchical all-reduce", ["parallel.allreduce='hierarchical'"]),
    ("ZeRO-3", ["parallel.zero=3"]),
    ("HSDP: ZeRO-3 shards inside nodes", ["parallel.zero=3", "parallel.dp_shard=2"]),
    ("4 micro-batches", ["parallel.pp=2", "parallel.tp=2", "parallel.microbatches=4"]),
]
# The calibration's groups (world ranks, node-major), each kind's at the same time. Inside a node
# both nodes at once, as in a step: the "nodes" share this machine's cores, and a loopback
# transfer is CPU work. Across, one pair (the link's rate) and both (sharing it).
LINK_GROUPS = {"intra": [[0, 1], [2, 3]], "inter": [[0, 2]],
               "inter, both pairs at once": [[0, 2], [1, 3]]}


def links(out: str, kinds: list[str], min_seconds: float = 0.2) -> None:
    """Under torchrun on the nodes: the all-reduces of `kinds` of LINK_GROUPS timed on their
    members, every size started together on every group of the kind (a world barrier, then as
    many calls as fill about `min_seconds`, agreed by all), the slowest member's seconds per
    call; rank 0's results written to `out` as JSON {kind: [(bytes, seconds), ...]}."""

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, found = dist.get_rank(), {}

    def seconds(group, t, calls: int) -> torch.Tensor:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls if group is not None else 0):
            all_reduce(t, group)
        per_call = torch.tensor([(time.perf_counter() - start) / calls])
        dist.all_reduce(per_call, op=dist.ReduceOp.MAX)  # the world's slowest member
        return per_call

    for kind in kinds:
        groups = LINK_GROUPS[kind]
        handles = [dist.new_group(g) for g in groups]  # every rank creates every group
        mine = next((h for g, h in zip(groups, handles, strict=True) if rank in g), None)
        samples = []
        for size in SIZES[kind.split(",")[0]]:
            t = torch.zeros(size // 4)  # zeros stay zeros however often they are summed
            seconds(mine, t, 1)  # warm-up: connections, allocations
            once = seconds(mine, t, 1).item()
            calls = max(3, min(1000, int(min_seconds / max(once, 1e-6))))
            samples.append((size, seconds(mine, t, calls).item()))
        found[kind] = samples
    if rank == 0:
        Path(out).write_text(json.dumps(found))
    dist.destroy_process_group()


def _job(nodes, args: list[str], logs: Path, port: int, timeout: float = 600) -> None:
    """One torchrun job of PER_NODE processes on every node; raises with the tail of the first
    failing node's output."""
    files = [open(logs / f"node{i}.log", "w") for i in range(NODES)]  # noqa: SIM115
    try:
        procs = [nodes.torchrun(i, PER_NODE, args, port=port, stdout=files[i],
                                stderr=subprocess.STDOUT) for i in range(NODES)]
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for f in files:
            f.close()
    for i, code in enumerate(codes):
        if code:
            tail = (logs / f"node{i}.log").read_text()[-3000:]
            raise RuntimeError(f"bench topology: node {i} exited {code}:\n{tail}")


def measure_links(nodes, work: Path, port: int, kinds: list[str]) -> dict[str, dict]:
    """Each of these link kinds' fitted alpha (s) and beta (bytes/s), and its samples."""
    out = work / f"links-{port}.json"
    chosen = ",".join(str(list(LINK_GROUPS).index(kind)) for kind in kinds)
    _job(nodes, ["-m", "plait.bench.topology", "links", str(out), chosen], work, port)
    return {kind: dict(zip(("alpha_s", "beta_Bps"), fit_alpha_beta(2, samples), strict=True),
                       samples=samples)
            for kind, samples in json.loads(out.read_text()).items()}


def measure_layout(nodes, overrides: list[str], work: Path, port: int, steps: int) -> dict:
    """Rank 0's median step time and time blocked in collectives over the steps after WARMUP."""
    metrics = work / f"metrics-{port}.jsonl"
    _job(nodes, ["-m", "plait", "train", "--metrics", str(metrics), *BASE, *overrides,
                 f"train.steps={steps + WARMUP}"], work, port)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()][WARMUP:]
    return {"step_s": statistics.median(r["step_time_s"] for r in rows),
            "comm_s": statistics.median(r["comm_wait_s"] for r in rows)}


def cluster_of(intra: dict, inter: dict):
    """The planner's model of the emulated cluster: this machine's calibrated compute shared by
    its 4 ranks, the links as measured, one inter-node link per node."""

    world = NODES * PER_NODE
    device = dataclasses.replace(
        cpu_device(world), name="cpu, 2 emulated nodes", intra_gbps=intra["beta_Bps"] / 1e9,
        intra_alpha_s=intra["alpha_s"], inter_gbps=inter["beta_Bps"] / 1e9,
        inter_alpha_s=inter["alpha_s"], node_link=True)
    return Cluster(world, PER_NODE, device)


def configured(overrides: list[str]):
    """(the configuration of a layout on the cluster, its degrees) (ConfigError if refused)."""

    cfg = load_config(None, [*BASE, *overrides, f"parallel.ranks_per_node={PER_NODE}"])
    return cfg, validate(cfg, NODES * PER_NODE)


def predict(overrides: list[str], cluster) -> dict:
    plan = estimate(*configured(overrides), cluster)
    return {"step_s": plan.step_time_s, "comm_s": plan.comm_s}


def run_topology(steps: int, ratios=RATIOS, quiet: bool = False, out: str = "") -> dict:
    """`plait bench topology`: calibrate, then every layout at every link rate; prints the
    tables (unless `quiet`), writes {"links": ..., "rows": [...]} to `out` (JSON) and returns
    it."""

    console = Console(width=170)
    if load() is None:
        print("bench topology: this machine is not calibrated; plait plan --calibrate first",
              file=sys.stderr)
        calibrate()
    names = [(node_layout(configured(overrides)[1], PER_NODE), variant)  # checked up front
             for variant, overrides in LAYOUTS]
    rows, calibrations, port = [], {}, 29600
    with tempfile.TemporaryDirectory(prefix="plait-topology-") as tmp, \
            EmulatedNodes(NODES) as nodes:
        work = Path(tmp)
        intra = measure_links(nodes, work, port, ["intra"])["intra"]  # before any shaping
        for ratio in ratios:
            rate_mbit = round(intra["beta_Bps"] * 8 / 1e6 / ratio, 1)
            nodes.set_rate(rate_mbit)
            port += 1
            found = measure_links(nodes, work, port, [k for k in LINK_GROUPS if k != "intra"])
            calibrations[ratio] = {**found, "intra": intra, "rate_mbit": rate_mbit}
            cluster = cluster_of(intra, found["inter"])
            runs = list(zip(names, LAYOUTS, strict=True))
            for (layout, variant), (_, overrides) in each(
                    runs, f"bench topology: loopback / {ratio}",
                    label=lambda run: ", ".join(n for n in run[0] if n)):
                port += 1
                measured = measure_layout(nodes, overrides, work, port, steps)
                plan = predict(overrides, cluster)
                rows.append({"layout": layout, "variant": variant, "ratio": ratio,
                             "rate_mbit": rate_mbit,
                             "link_gbps": found["inter"]["beta_Bps"] / 1e9,
                             "predicted_s": plan["step_s"], "measured_s": measured["step_s"],
                             "predicted_comm_s": plan["comm_s"],
                             "measured_comm_s": measured["comm_s"]})
    if not quiet:
        print_links(console, calibrations)
        print_rows(console, rows)
    found = {"links": calibrations, "rows": rows}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(found, indent=1) + "\n")
    return found


def print_links(console: Console, calibrations: dict) -> None:
    table = Table(title="plait bench topology: the emulated cluster's links (gloo all-reduces "
                        "of 2 ranks, 4 KiB-16 MiB, fitted to t = 2 alpha + bytes / beta)")
    for col in ("inter-node link", "link kind", "alpha us", "beta MB/s"):
        table.add_column(col, justify="left" if col != "alpha us" and col != "beta MB/s"
                         else "right")
    for ratio, found in calibrations.items():
        label = f"loopback / {ratio} ({found['rate_mbit']:.0f} Mbit/s shaped)"
        for kind in ("intra", *[k for k in LINK_GROUPS if k != "intra"]):
            link = found[kind]
            table.add_row(label, kind, f"{link['alpha_s'] * 1e6:,.0f}",
                          f"{link['beta_Bps'] / 1e6:,.1f}")
    console.print(table)


def print_rows(console: Console, rows: list[dict]) -> None:
    table = Table(title="plait bench topology: 2 emulated nodes x 2 processes, 'small' preset, "
                        "8 x 128 tokens; rank 0, median step after warm-up")
    for col in ("inter-node link", "layout", "step ms predicted", "measured", "error",
                "comm wait ms predicted", "measured"):
        table.add_column(col, justify="left" if col in ("inter-node link", "layout")
                         else "right")
    for r in rows:
        error = r["predicted_s"] / r["measured_s"] - 1
        layout = r["layout"] + (f" ({r['variant']})" if r["variant"] else "")
        table.add_row(f"loopback / {r['ratio']} ({r['link_gbps'] * 1e3:,.0f} MB/s)", layout,
                      f"{r['predicted_s'] * 1e3:,.0f}", f"{r['measured_s'] * 1e3:,.0f}",
                      f"{error:+.0%}", f"{r['predicted_comm_s'] * 1e3:,.0f}",
                      f"{r['measured_comm_s'] * 1e3:,.0f}")
    console.print(table)


if __name__ == "__main__":  # under torchrun, on the emulated nodes
    if sys.argv[1:2] == ["links"]:
        links(sys.argv[2], [list(LINK_GROUPS)[int(i)] for i in sys.argv[3].split(",")])
    else:
        sys.exit(f"usage: python -m plait.bench.topology links OUT.json KINDS (indices of "
                 f"LINK_GROUPS, comma-separated), not {sys.argv[1:]}")
