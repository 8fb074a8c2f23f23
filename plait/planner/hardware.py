"""The machines a plan is priced on: per device its dense bf16 peak and memory, per link its
bandwidth and latency (the alpha-beta model: a collective of n steps moving B bytes per rank takes
n alpha + B / beta).

Sources, vendors' datasheets (dense, no sparsity): A100 SXM 80 GB, 312 TFLOP/s bf16, NVLink 3 at
600 GB/s both directions (300 each way); H100 SXM 80 GB, 989 TFLOP/s, NVLink 4 at 900 GB/s (450);
the H100's card forms (NVIDIA's H100 datasheet, 2023): H100 PCIe 80 GB, 756 TFLOP/s, H100 NVL
94 GB, 835 TFLOP/s, both PCIe 5.0 x16 (64 GB/s each way), which is what links a node's cards here
(their NVLink bridges join pairs of cards only; a pair-only layout is given with
--intra-node-gbps 300); a variant of its own (the 96 GB / 500 W H100s of some clusters) is a named
device with --gpu-memory-gb and --gpu-tflops;
H200 SXM 141 GB, 989 TFLOP/s, NVLink 4; B200 180 GB, 2.25 PFLOP/s, NVLink 5 at 1.8 TB/s (900).
Between nodes one 400 Gb/s InfiniBand NDR port per GPU (50 GB/s; 200 Gb/s HDR, 25 GB/s, in the
A100 generation). Host side (offload): PCIe 4.0 x16 (A100) moves 32 GB/s each way, PCIe 5.0 x16
(H100 on) 64; a DGX node has 2 TB of host memory (1 TB for the DGX A100 80GB).

PCIe cards with no NVLink (24 and 48 GB, the seeds' "4 x 24 GB GPUs"): RTX 4090 24 GB, 165
TFLOP/s bf16 dense (fp32 accumulation); A10 24 GB, 125; L4 24 GB, 121; RTX A6000 48 GB, 155;
L40S 48 GB, 362; all PCIe 4.0 x16, which is also their link to each other within a node (32 GB/s
each way; the A6000's two-card NVLink bridge is left out), 100 Gb/s Ethernet between nodes (12.5
GB/s), 256 GB of host memory per node (a workstation or a cloud VM of 4 to 8 of them).

The generation before bf16 (fp16 tensor cores only, plait's `train.precision = "fp16"`): V100
SXM2 32 GB, 125 TFLOP/s fp16 dense, NVLink 2 at 300 GB/s (150 each way), PCIe 3.0 x16 (16 GB/s),
100 Gb/s EDR InfiniBand between nodes (12.5 GB/s), 768 GB of host memory (DGX-1V 32GB is 512,
DGX-2 1.5 TB; we take the middle); T4 16 GB, 65 TFLOP/s fp16, PCIe 3.0 x16 as its only link, 100
Gb/s Ethernet between nodes. On these bf16 runs without tensor cores: the planner says so.

Per device also its SM count, memory bandwidth and whether it has fp8 tensor cores (Hopper, Ada,
Blackwell), from the same datasheets (`planner.gemm` prices a step's compute from them).

The CPU side of optimizer offload (the AdamW update on the host) is priced as memory-bound: 32
bytes per parameter (read and write the fp32 master and two moments, read the gradient) at 100
GB/s of host memory bandwidth per node, shared by its GPUs (an assumption, not a measurement), or
at 3.4 GB/s per `train.threads` thread (plait's AdamW on one thread of an H200 machine's host,
measured), whichever is less.
`cpu` is this machine: one rank per core, its measured fp32 matmul rate, gloo on
loopback, as `plait plan --calibrate` measured it (`plait.planner.calibrate`); gloo's reduce-scatter
is an all-reduce (`plait bench topology` measured it so), and is priced as one. Emulated nodes
(`plait bench topology`) have one inter-node link per node, shared by the groups crossing it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from plait.config.schema import ConfigError
from plait.planner.gemm import FLASH2_SHARE  # plain numbers: no torch

GB = 1e9


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # per device, dense bf16 or fp16 (fp32 for the CPU)
    memory_bytes: float
    intra_gbps: float  # GB/s each way per device, within a node
    inter_gbps: float  # GB/s each way per device, between nodes
    intra_alpha_s: float = 5e-6  # per message step
    inter_alpha_s: float = 10e-6
    efficiency: float = 0.55  # a CPU's: share of its matmul rate a step reaches (calibrated;
    # a GPU's compute comes from shapes: `planner.gemm`)
    # Measured on a CPU (`plait plan --calibrate`); a GPU's are hidden by asynchronous launches.
    step_overhead_s: float = 0.0  # per optimizer step, beyond the matmuls
    microbatch_overhead_s: float = 0.0  # per micro-batch through the whole model
    overlap: bool = True  # collectives run beside compute (not when ranks fill every core)
    pcie_gbps: float = 32.0  # GB/s each way between a device and host memory (offload)
    host_memory_bytes: float = 256 * GB  # per node
    host_gbps: float = 100.0  # host memory bandwidth per node (the CPU's optimizer step)
    # What one thread of plait's offloaded AdamW step reaches, counted as 32 bytes per element:
    # 1.5B elements took 14.3 s on one thread of an H200 machine's host (docs/benchmarks.md).
    host_thread_gbps: float = 3.4
    bf16: bool = True  # has bf16 tensor cores (`peak_flops` is then the bf16 and fp16 peak)
    # One inter-node link per node (`inter_gbps` is then the node's), shared by the groups that
    # cross it at once: emulated nodes (`plait bench topology`). A GPU cluster has a NIC per GPU.
    node_link: bool = False
    gloo: bool = False  # collectives by gloo (the CPU), whose reduce-scatter is an all-reduce
    sms: int = 132  # streaming multiprocessors: how many tiles of a matmul run at once
    hbm_gbps: float = 3350.0  # device memory bandwidth (GB/s): elementwise work, the optimizer
    fp8: bool = False  # has fp8 tensor cores, at twice the dense bf16 peak
    # Hopper and later: cuDNN's attention kernel (the one the attention rates were measured
    # with) outruns FlashAttention-2 there (`gemm.FLASH2_SHARE`); on earlier GPUs FA2 is the
    # kernel of their generation, priced at the same rates.
    hopper: bool = False


DEVICES = {
    "a100": Device("A100 SXM 80GB", 312e12, 80 * GB, 300, 25, host_memory_bytes=1000 * GB,
                   sms=108, hbm_gbps=2039),
    "h100": Device("H100 SXM 80GB", 989e12, 80 * GB, 450, 50, pcie_gbps=64,
                   host_memory_bytes=2000 * GB, fp8=True, hopper=True),
    # torchtitan's benchmark cluster (Grand Teton): 96 GB HBM2e at 2.4 TB/s, a 500 W limit; its
    # peak "between SXM and NVL" by torchtitan's note, taken as their midpoint.
    "h100-96gb": Device("H100 96GB 500W", 912e12, 96 * GB, 450, 50, pcie_gbps=64,
                        host_memory_bytes=2000 * GB, hbm_gbps=2400, fp8=True, hopper=True),
    "h100-pcie": Device("H100 PCIe 80GB", 756e12, 80 * GB, 64, 50, pcie_gbps=64, sms=114,
                        hbm_gbps=2000, fp8=True, hopper=True),
    "h100-nvl": Device("H100 NVL 94GB", 835e12, 94 * GB, 64, 50, pcie_gbps=64, hbm_gbps=3900,
                       fp8=True, hopper=True),
    "h200": Device("H200 SXM 141GB", 989e12, 141 * GB, 450, 50, pcie_gbps=64,
                   host_memory_bytes=2000 * GB, hbm_gbps=4800, fp8=True, hopper=True),
    "b200": Device("B200 180GB", 2250e12, 180 * GB, 900, 50, pcie_gbps=64,
                   host_memory_bytes=2000 * GB, sms=148, hbm_gbps=8000, fp8=True, hopper=True),
    "rtx4090": Device("RTX 4090 24GB", 165e12, 24 * GB, 32, 12.5, sms=128, hbm_gbps=1008,
                      fp8=True),
    "a10": Device("A10 24GB", 125e12, 24 * GB, 32, 12.5, sms=72, hbm_gbps=600),
    "l4": Device("L4 24GB", 121e12, 24 * GB, 32, 12.5, sms=58, hbm_gbps=300, fp8=True),
    "a6000": Device("RTX A6000 48GB", 155e12, 48 * GB, 32, 12.5, sms=84, hbm_gbps=768),
    "l40s": Device("L40S 48GB", 362e12, 48 * GB, 32, 12.5, sms=142, hbm_gbps=864, fp8=True),
    "v100": Device("V100 SXM2 32GB", 125e12, 32 * GB, 150, 12.5, pcie_gbps=16,
                   host_memory_bytes=768 * GB, bf16=False, sms=80, hbm_gbps=900),
    "t4": Device("T4 16GB", 65e12, 16 * GB, 16, 12.5, pcie_gbps=16, bf16=False, sms=40,
                 hbm_gbps=320),
}


def known_device(cuda_name: str) -> Device | None:
    """The device of this table a CUDA device name is ("NVIDIA H100 80GB HBM3", "NVIDIA
    A100-SXM4-80GB", "NVIDIA A10G", "NVIDIA GeForce RTX 4090"): every word of a key ("h100-pcie":
    H100 and PCIE) a word of the name, or failing that the start of one, or failing that the key
    within the name's letters run together; the key naming most words wins."""
    words = cuda_name.upper().replace("-", " ").split()

    def matches(key: str, how: str) -> bool:
        if how == "within":
            return key.upper().replace("-", "") in "".join(words)
        return all(any(w == k if how == "exact" else w.startswith(k) for w in words)
                   for k in key.upper().split("-"))

    for how in ("exact", "start", "within"):
        found = [key for key in DEVICES if matches(key, how)]
        if found:
            return DEVICES[max(found, key=lambda k: k.count("-"))]
    return None


def host_memory_per_rank(ranks: int) -> float:
    """This machine's memory, shared by `ranks` ranks."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(ranks, 1)


def calibrated_device(found: dict, ranks: int) -> Device:
    """The `cpu` device for a job of `ranks` ranks on the measured machine: the links measured
    at the nearest world size at or below it, compute shared when ranks exceed the cores."""
    measured = sorted(int(n) for n in found["links"])
    n = max([m for m in measured if m <= ranks] or measured[:1])
    link = found["links"][str(n)]
    share = min(1.0, found["cores"] / ranks)
    return replace(
        Device(f"cpu (calibrated {found['measured_at']})", found["matmul_flops"],
               host_memory_per_rank(ranks),
               link["beta_Bps"] / 1e9, link["beta_Bps"] / 1e9),
        intra_alpha_s=link["alpha_s"], inter_alpha_s=link["alpha_s"],
        efficiency=found["efficiency"] * share, step_overhead_s=found["step_overhead_s"] / share,
        microbatch_overhead_s=found["microbatch_overhead_s"] / share,
        overlap=ranks < found["cores"], gloo=True)


def cpu_device(ranks: int = 1) -> Device:
    """This machine for a job of `ranks` ranks: as `plait plan --calibrate` measured it, or, not
    yet calibrated, one core's fp32 matmul rate measured now with loopback gloo guessed (about
    1 GB/s and 1 ms per message step on 2 cores, from `plait bench comm`)."""
    # Imported here: calibrate measures with torch, which pricing a GPU layout never needs.
    from plait.planner.calibrate import load, measure_cpu_flops

    found = load()
    if found is not None:
        return calibrated_device(found, ranks)
    return Device("cpu (not calibrated: plait plan --calibrate)", measure_cpu_flops(),
                  host_memory_per_rank(ranks), 1.0, 1.0, intra_alpha_s=1e-3,
                  inter_alpha_s=1e-3, efficiency=1.0, gloo=True)


def device(name: str, intra_gbps: float | None = None, inter_gbps: float | None = None,
           ranks: int = 1, memory_gb: float | None = None,
           tflops: float | None = None) -> Device:
    """A named device (KeyError if unknown), links, memory and dense bf16 peak (`tflops`, a
    variant's own: a 96 GB / 500 W H100 is not the SXM datasheet's) overridden where given;
    `cpu` is this machine for a job of `ranks` ranks."""
    found = cpu_device(ranks) if name == "cpu" else DEVICES[name]
    if memory_gb is not None:
        found = replace(found, name=f"{found.name} at {memory_gb:g} GB",
                        memory_bytes=memory_gb * GB)
    if tflops is not None:
        found = replace(found, name=f"{found.name} at {tflops:g} TFLOP/s",
                        peak_flops=tflops * 1e12)
    if intra_gbps is not None:
        found = replace(found, intra_gbps=intra_gbps)
    if inter_gbps is not None:
        found = replace(found, inter_gbps=inter_gbps)
    return found


@dataclass(frozen=True)
class Engine:
    """What the step's implementation adds to the hardware (`planner.gemm`): plait's eager step
    moves 26 times its activations' bytes through memory (measured on an H200); an engine of
    hand-fused kernels (Megatron-LM's) `FUSED_PASSES`, the floor: each activation written once
    and read once, its gradient written once and read once (torch.compile's fusion is not
    modeled).
    `fp8`: the linear layers' matmuls in fp8 (`train.precision = "fp8"`, priced only), the
    output head's in bf16, with the casts' traffic (`gemm.fp8_cast_bytes`).
    `attention_kernel`: its attention kernel's rate against the one measured (torch 2.11's SDPA
    on Hopper, cuDNN's), on Hopper and later (`Device.hopper`): `gemm.FLASH2_SHARE` for an
    engine on FlashAttention-2.
    `autocast`: half precision by autocast over fp32 parameters where the layout keeps them
    whole (plait's), which casts sequence parallelism's gathered inputs
    (`activations.regathered_bytes`); Megatron-LM keeps half parameters and casts nothing: its
    runs are priced as plait's half parameters (`train.param_dtype`, `planned_precision`), whose
    residual stream, tensor-parallel reductions and pipeline sends are half too.
    `sequence_parallel`: whether the engine can shard the norms and the residual over tp (the
    search tries it where tp > 1); Megatron-LM of 2021 could not (Korthikanti et al. 2022 added
    it), so its layouts are priced with the norms whole on every tp rank.
    `zero3_wrap`, `max_live_params`: ZeRO-3's units and its bound on the parameters gathered at
    once, where the run does not set them: DeepSpeed gathers each module's own parameters
    (every module holding any: `parallel.wrap = "1"`), at most `stage3_max_live_parameters`
    (its default 1e9) at once; plait and torchtitan (FSDP2 per block) gather a block.
    `compiled_passes`: the elementwise passes when the blocks and the loss are compiled
    (`train.compile`, on for CUDA by default), None where compilation is not modeled (the
    engine's passes).
    `optimizer_bytes`: what the optimizer moves per element of its slice each step (`gemm`).
    `compile_s`: seconds to compile one distinct block before the first step."""

    name: str = "plait"
    elementwise_passes: float = 26.0
    fp8: bool = False
    # Data-parallel gradient reduction beside the backward (plait's buckets, torch's DDP and
    # FSDP); Megatron-LM of 2021 all-reduced after the backward (its "local" DDP).
    overlap_dp: bool = True
    attention_kernel: float = 1.0
    autocast: bool = True
    compiled_passes: float | None = None
    optimizer_bytes: float = 96.0  # AdamW foreach (torch's default), measured on the H200
    compile_s: float = 0.0
    sequence_parallel: bool = True
    zero3_wrap: str = ""  # ZeRO-3's units: `parallel.wrap` ("": the plan's blocks)
    max_live_params: int = 0  # ZeRO-3's bound on gathered elements (`parallel.max_live_params`)


FUSED_PASSES = 4.0
# The elementwise passes when the blocks and the fused loss are compiled: fitted so that the 1B's
# compiled step is to its eager one as measured on an H100 in one run (0.2819 / 0.4327 s,
# docs/benchmarks.md "plait bench gpu"). Inductor's fused kernels take only 0.20-0.23 of the
# eager blocks' elementwise kernel time (four 1B blocks profiled), but the eager passes, fitted
# to whole steps, also hold what is not those kernels (launches, the norm's and the optimizer's
# extra passes), which compiling keeps: 9.3 of the 26 passes.
COMPILED_PASSES = 9.3
# torch's fused AdamW (plait's on CUDA, `optim/build.py`): reads the fp32 parameter, gradient and
# two moments, writes the parameter and moments, once: 28 bytes an element (the H100's eager 1B
# step lost 47 ms with it and the one-pass gradient norm: 36 ms of the foreach AdamW's 96 bytes
# down to 28 at its memory rate, and ~30 GB of the norm's fp64 copies).
FUSED_ADAMW_BYTES = 28.0
# The first compiled step of the 1B on an H100 took 6-11 s more than the eager one (one block
# compiled by inductor for all 16 layers, torch 2.11; docs/benchmarks.md "plait bench gpu").
COMPILE_S = 8.0
# plait as it runs today: compiled blocks on CUDA, fused AdamW.
PLAIT = Engine("plait", compiled_passes=COMPILED_PASSES, optimizer_bytes=FUSED_ADAMW_BYTES,
               compile_s=COMPILE_S)
# plait's eager step before fused AdamW (2026-11-26), which the own-step rows measured.
PLAIT_2026_11_26 = Engine("plait-2026-11-26")
# The engines a plan can be priced as (`plait plan --engine`), as the published rows ran
# (plait/bench/published.py names their sources): Megatron-LM of 2021 fused its elementwise
# kernels and all-reduced gradients after the backward, on half parameters, without sequence
# parallelism; Megatron-LM since (and the Llama 3 runs' engine) with both, the reductions
# overlapped with the backward (its distributed optimizer's buckets); DeepSpeed's ZeRO on half
# parameters, eager, gathering each module's parameters under its live bound; torchtitan's
# torch of 2024-2025 ran FlashAttention-2 under eager blocks.
ENGINES = {
    "plait": PLAIT,
    "plait-2026-11-26": PLAIT_2026_11_26,
    "megatron-2021": Engine("megatron-2021", FUSED_PASSES, overlap_dp=False, autocast=False,
                            sequence_parallel=False),
    "megatron": Engine("megatron", FUSED_PASSES, autocast=False),
    "deepspeed": Engine("deepspeed", autocast=False, sequence_parallel=False, zero3_wrap="1",
                        max_live_params=10**9),
    "torchtitan": Engine("torchtitan", attention_kernel=FLASH2_SHARE),
}


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    device: Device
    engine: Engine = PLAIT

    @property
    def per_node(self) -> int:
        """GPUs in a node of this cluster (all of them, when fewer than a node)."""
        return min(self.gpus, self.gpus_per_node)

    def within_node(self, stride: int, size: int) -> bool:
        """Whether a group of `size` ranks `stride` apart on the row-major mesh lies in one node
        (ranks fill nodes in order)."""
        span = stride * size
        return span <= self.gpus_per_node and self.gpus_per_node % span == 0

    def link(self, stride: int, size: int) -> tuple[float, float]:
        """(bytes/s each way, alpha) of such a group's slowest link. Over one link per node, the
        groups of an axis crossing a node at once share it: min(stride, G) of them (a group of
        stride s < G keeps G / s consecutive members per node, so s groups enter and leave it;
        of stride >= G, each of the node's G ranks is in a group of its own)."""
        d = self.device
        if self.within_node(stride, size):
            return d.intra_gbps * GB, d.intra_alpha_s
        sharing = min(stride, self.per_node) if d.node_link else 1
        return d.inter_gbps * GB / sharing, d.inter_alpha_s


# What `plait plan` accepts for a device of another kind: wide of every device made (a CPU core's
# few TFLOP/s to a rack's, a phone's memory to a node's), and narrow enough that a step's time
# and a layout's bytes stay ordinary finite numbers (1e-300 TFLOP/s priced a 300-digit step).
TFLOPS = (0.01, 1e5)
MEMORY_GB = (0.1, 1e6)
LINK_GBPS = (0.001, 1e5)


def check_options(args) -> None:
    """`plait plan`'s cluster options, each refused in one line (`ConfigError`)."""

    if args.gpus is None:
        raise ConfigError("--gpus", "required: the number of devices the job runs on")
    for option, value in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node),
                          ("--top", args.top)):
        if value < 1:
            raise ConfigError(option, f"at least 1, got {value}")
    for option, value, (low, high) in (("--intra-node-gbps", args.intra_node_gbps, LINK_GBPS),
                                       ("--inter-node-gbps", args.inter_node_gbps, LINK_GBPS),
                                       ("--gpu-memory-gb", args.gpu_memory_gb, MEMORY_GB),
                                       ("--gpu-tflops", args.gpu_tflops, TFLOPS)):
        if value is not None and not low <= value <= high:
            raise ConfigError(option, f"in [{low:g}, {high:g}], got {value:g}")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        raise ConfigError("--gpus-per-node", f"must divide --gpus={args.gpus} (whole nodes), "
                          f"got {args.gpus_per_node}")
    if args.gpu not in (*DEVICES, "cpu"):
        raise ConfigError("--gpu", f"one of {', '.join(DEVICES)}, cpu; got {args.gpu!r}")


def planned_precision(cfg, cluster: Cluster):
    """(cfg, cluster) as priced: `train.precision = "fp8"` is bf16's model state and activations
    with the linear layers' matmuls in fp8 (torchtitan's float8 training: Float8Linear keeps bf16
    weights and activations between layers), on a device that has fp8 tensor cores. An engine
    without autocast holds its parameters in the half precision (`train.param_dtype`, where the
    run leaves it "auto")."""

    if not cluster.engine.autocast and cfg.train.param_dtype == "auto" and \
            cfg.train.precision in ("bf16", "fp16", "fp8"):
        half = "bf16" if cfg.train.precision == "fp8" else cfg.train.precision
        cfg = replace(cfg, train=replace(cfg.train, param_dtype=half))
    if cfg.train.precision != "fp8":
        return cfg, cluster
    if not cluster.device.fp8:
        raise ConfigError("train.precision", f"{cluster.device.name} has no fp8 tensor cores: "
                          "use 'bf16'")
    train = replace(cfg.train, precision="bf16")
    return replace(cfg, train=train), replace(cluster, engine=replace(cluster.engine, fp8=True))
