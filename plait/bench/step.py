"""`plait bench step --nproc N [overrides]`: a training step under plait's data parallelism
against the same step under PyTorch's own peer, in one run:

    parallel.zero = 0     plait DDP         vs  torch.nn.parallel.DistributedDataParallel
    parallel.zero = 1, 2  plait ZeRO-1 / 2  vs  DDP + torch ZeroRedundancyOptimizer
    parallel.zero = 3     plait ZeRO-3      vs  torch.distributed.fsdp.fully_shard (per block, root)

in the run's `train.precision`: the peers under autocast, fully_shard with a
`MixedPrecisionPolicy`, fp16 with `torch.amp.GradScaler` / FSDP's `ShardedGradScaler`.

Per world size (1, 2, 4, ... up to N; the same global batch each time, i.e. strong scaling) each
side runs in processes of its own, as its users run it (torch's never sets plait's glibc
threshold, `plait/host_memory.py`), the sides taking turns over `--repeats` launches: plait's
step with, for plain DDP, plait with communication skipped (every micro-batch under `no_sync`,
no all-reduce), taking turns within its processes; then torch's. Reported, from the medians of
all their steps, with each side's spread and the machine's other load (`load.py`):

- ratio plait / torch (below 1: plait is faster);
- exposed communication: (plait step - step without communication) / plait step, the part of the
  all-reduce that backward did not hide;
- scaling efficiency T1 / (N * TN).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from plait import comm
from plait.config.schema import Config, ModelConfig, microbatches
from plait.data.batches import TokenData
from plait.host_memory import STEADY_THRESHOLD, malloc_threshold, release_freed_memory
from plait.mesh import build_mesh
from plait.model.plan import has_plan, plan_of
from plait.optim.loss_scaling import HALF
from plait.parallel.engines.ddp import BucketedDataParallel
from plait.train.checks import validate
from plait.train.trainer import Trainer, build_configured_model


def world_sizes(nproc: int) -> list[int]:
    sizes = [1]
    while sizes[-1] * 2 <= nproc:
        sizes.append(sizes[-1] * 2)
    return sizes if sizes[-1] == nproc else [*sizes, nproc]


def with_free_dp(cfg: Config) -> Config:
    """The benchmark sets the world size; dp takes it whole."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=0))


class _Runner:
    """One model, its optimizer, and a step over this rank's rows in micro-batches; in a half
    precision under autocast, fp16 with a loss scaler (torch's `GradScaler`, or FSDP's
    `ShardedGradScaler`), as torch's recipes do."""

    def __init__(self, wrapped, opt, micro_batches, communicate=True, half=None, scaler=None):
        self.wrapped, self.opt, self.micro_batches = wrapped, opt, micro_batches
        self.communicate, self.half, self.scaler = communicate, half, scaler

    def step(self) -> None:
        self.wrapped.zero_grad(set_to_none=True)
        self.opt.zero_grad(set_to_none=True)
        last = len(self.micro_batches) - 1
        compute = (torch.autocast("cpu", dtype=self.half) if self.half is not None
                   else contextlib.nullcontext())
        for i, (x, y) in enumerate(self.micro_batches):
            sync = self.communicate and i == last
            with contextlib.nullcontext() if sync else self.wrapped.no_sync():
                with compute:
                    logits = self.wrapped(x)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                loss = loss / len(self.micro_batches)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
        if self.communicate and hasattr(self.wrapped, "finish_gradients"):
            self.wrapped.finish_gradients()
        if self.scaler is None:
            self.opt.step()
            return
        self.scaler.step(self.opt)  # unscales, skips an overflowing step
        self.scaler.update()


def as_plaits_llama(cfg: Config) -> Config:
    """`cfg` with its Hugging Face model (`model.hf`) replaced by plait's own Llama of the same
    shape (`hf_args`: width, layers, heads, MLP, vocabulary)."""

    shape = dataclasses.asdict(cfg.model.args())
    return dataclasses.replace(cfg, model=ModelConfig(preset="tiny", overrides=shape))


def plait_step(cfg: Config, dims, mesh):
    """plait's side of every bench: the trainer's own step (one path for every configuration),
    on the same global batch each time, unclipped as the peers are."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_clip=0.0))
    trainer = Trainer(cfg, dims, mesh, torch.device("cpu"))
    return lambda: trainer.train_step(0)


def torch_runner(model, mesh, cfg: Config, batches) -> _Runner:
    """PyTorch's peer of the run's engine, in the run's precision: DDP (+ ZeroRedundancyOptimizer)
    under autocast over fp32 parameters, fully_shard with `MixedPrecisionPolicy` (half parameters
    and compute, fp32 reductions); fp16 with torch's loss scalers, from the run's initial scale."""
    group, par, train = mesh["dp"].get_group(), cfg.parallel, cfg.train
    half = HALF.get(train.precision)
    fp16 = train.precision == "fp16"
    init = train.loss_scale_init if train.loss_scale == "dynamic" else float(train.loss_scale)
    if par.zero == 3:
        policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
        blocks = model.get_submodule(plan_of(model).blocks).values() if has_plan(model) else ()
        for block in blocks:
            fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
        fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = ShardedGradScaler("cpu", init_scale=init, process_group=group) if fp16 else None
        return _Runner(_NoSync(model), opt, batches, scaler=scaler)  # the policy casts
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=par.bucket_mb)
    if par.zero:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      process_group=group, lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=init) if fp16 else None
    return _Runner(ddp, opt, batches, half=half, scaler=scaler)


class _NoSync(torch.nn.Module):
    """fully_shard modules accumulate with set_requires_gradient_sync; give them no_sync()."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)

    @contextlib.contextmanager
    def no_sync(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)


def step_times(steps_by_name: dict, group, steps: int) -> dict[str, list[float]]:
    """Seconds of each timed step of each step function, the slowest rank's. The functions take
    turns in rotating order (none always first), all ranks starting each together; two rounds
    warm up."""
    times = {name: [] for name in steps_by_name}
    order = list(steps_by_name)
    for i in range(steps + 2):
        k = i % len(order)
        for name in order[k:] + order[:k]:
            comm.all_reduce(torch.zeros(1), group)  # start together
            start = time.perf_counter()
            steps_by_name[name]()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        t = torch.tensor(ts)
        comm.all_reduce(t, group, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        times[name] = t.tolist()
    return times


def summarize(times: dict[str, list[float]]) -> dict[str, float]:
    """Each name's median seconds, and its spread (`<name>_spread`): the interquartile range over
    the median."""
    out = {}
    for name, ts in times.items():
        quartiles = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        out[name] = statistics.median(ts)
        out[f"{name}_spread"] = (quartiles[2] - quartiles[0]) / out[name]
    return out


def time_in_turns(steps_by_name: dict, group, steps: int) -> dict[str, float]:
    """`summarize(step_times(...))`: for the benches whose sides share their processes."""
    return summarize(step_times(steps_by_name, group, steps))


def start_worker(cfg: Config):
    """A bench worker's start: its threads, the gloo process group, the checked degrees and the
    mesh. Returns (dims, mesh)."""
    torch.set_num_threads(cfg.train.threads)
    dist.init_process_group("gloo")
    dims = validate(cfg, dist.get_world_size())
    return dims, build_mesh(dims)


SIDES = ("plait", "torch")  # each in processes of its own (run_step)
# plait's DDP with communication skipped, the exposed-communication baseline of a DDP row: in
# processes of its own too, so that plait's processes hold one model, as the peer's do.
NO_COMM = "no_comm"


@record
def bench_step(cfg: Config, steps: int, side: str) -> dict | None:
    """One side's step times on this world: plait's ("plait", and for a Hugging Face model
    plait's Llama of its shape), the peer's ("torch") or plait's DDP without communication
    (`NO_COMM`), and the glibc threshold this process set (None: glibc's own, as a user of
    torch alone has it)."""
    # fully_shard's ShardedGradScaler replicates its one-element found-inf tensors, and says so.
    warnings.filterwarnings("ignore", "Found a non-scalar tensor with numel=1")
    dims, mesh = start_worker(cfg)
    group = mesh["dp"].get_group()
    rank, n = dist.get_rank(), dims.dp
    x, y = TokenData(cfg.data, cfg.train.seed).batch(0, cfg.train.global_batch, rank, n)
    micro = len(x) // microbatches(cfg.parallel, dims)
    batches = list(zip(x.split(micro), y.split(micro), strict=True))

    def model():
        return build_configured_model(cfg)

    if side == "torch":
        runners = {"torch": torch_runner(model(), mesh, cfg, batches).step}
    elif side == NO_COMM:
        local = model()
        half = HALF.get(cfg.train.precision)
        scaler = torch.amp.GradScaler("cpu") if cfg.train.precision == "fp16" else None
        runners = {NO_COMM: _Runner(BucketedDataParallel(local, group),
                                    torch.optim.AdamW(local.parameters(), lr=1e-4), batches,
                                    communicate=False, half=half, scaler=scaler).step}
        release_freed_memory(STEADY_THRESHOLD)  # plait's step's allocator, as its trainer has it
    else:
        runners = {"plait": plait_step(cfg, dims, mesh)}
    if side == "plait" and cfg.model.hf:  # running someone else's module: vs plait's Llama
        runners["llama"] = plait_step(as_plaits_llama(cfg), dims, mesh)
    times = step_times(runners, group, steps)
    dist.destroy_process_group()
    return {**times, "malloc_threshold": malloc_threshold()} if rank == 0 else None
