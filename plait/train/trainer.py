"""The training loop: one step path for every configuration. The schedule's executor runs the
micro-batches forward and backward (one pipeline stage: gradient accumulation), the data-parallel
engine finishes the gradients, one global norm clips them, AdamW with warm-up + cosine steps;
validation and metrics.

The trainer owns no process group: it is handed the mesh, so tests can drive it from any harness.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.checkpoint import find
from plait.checkpoint.rank_state import load
from plait.comm import LEDGER, all_reduce, broadcast
from plait.comm.trace import TRACER
from plait.config.choices import held_precision
from plait.config.schema import Config, microbatches
from plait.data.mixture import MIXTURE, mixture_history, open_data
from plait.host_memory import STEADY_THRESHOLD, release_freed_memory
from plait.mesh import ParallelDims, rows_share, world_axis
from plait.model import count_params
from plait.optim.build import build_for, lr_at, set_lr
from plait.optim.loss_scaling import HALF, LossScaler
from plait.parallel import Options, cross_entropy, parallelize
from plait.parallel.compile import apply_compile, compile_enabled, graph_breaks
from plait.parallel.dropout import seed_ranks
from plait.predict.activation_memory import SavedActivations
from plait.predict.trace import Untraceable, model_flops
from plait.train.checkpointing import Checkpointer
from plait.train.faults import maybe_fail
from plait.train.metrics import MetricsWriter, RouterMetrics, flops_per_token, peak_flops
from plait.train.outputs import Outputs
from plait.train.progress import Progress
from plait.train.tracing import STEP, finish_trace, traced_steps
from plait.train.verify import Verdict, held_as_the_layout, verify_step


def build_configured_model(cfg: Config, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model `cfg.model` names, whole, on `device`: plait's Llama of a preset, or the Hugging
    Face folder `model.hf` (`plait/model/hf.py`), both initialised from `train.seed`."""
    return cfg.model.build(cfg.train.seed, device)


class NonFiniteGradient(RuntimeError):
    """The global gradient norm of a step is NaN or infinite (train.nan_policy = "stop")."""


@dataclass
class Summary:
    losses: list[float] = field(default_factory=list)
    val_loss: float = float("nan")
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    flops_per_step: float = 0.0  # the model's (MFU's numerator: `Trainer._rates`)
    comm_bytes_per_step: float = 0.0
    model_state_bytes: dict[str, int] = field(default_factory=dict)
    skipped_steps: int = 0
    loss_scale: float = 0.0  # fp16: the scale at the end (0: no loss scaling)
    moe: list[dict] = field(default_factory=list)  # each step's routing metrics (MoE models)
    mem_predicted_peak: int = 0  # the largest step's model state + activations, as counted
    gpu_mem_allocated_peak: int | None = None  # the device's own peaks (None on the CPU)
    gpu_mem_reserved_peak: int | None = None


class Trainer:
    def __init__(self, cfg: Config, dims: ParallelDims, mesh, device: torch.device,
                 verify: bool = False):
        self.cfg, self.train_cfg, self.device = cfg, cfg.train, device
        args = cfg.model.args()
        # On the CPU, freed build temporaries go back to the kernel at once, until the first
        # step is over (`train_step`).
        self._steady = device.type != "cpu" or not release_freed_memory()
        # On `meta`: each rank materializes only what it holds, once the model is cut.
        model, source = cfg.model.build_sharded(cfg.train.seed, device)
        # --verify: the whole model, for one step of a single process to compare with, its
        # parameters held as the layout holds its own.
        held = held_precision(cfg.train.precision, cfg.train.param_dtype, cfg.parallel.zero)
        self.reference = held_as_the_layout(build_configured_model(cfg, device), held) \
            if verify else None
        n_params = count_params(model)  # the whole model's, before any split
        torch.manual_seed(cfg.train.seed)  # dropout's masks follow from it (parallel/dropout.py)
        self.microbatches = microbatches(cfg.parallel, dims)
        self.parallelized = parallelize(model, mesh, cfg.parallel, Options(
            microbatches=self.microbatches, precision=cfg.train.precision,
            param_dtype=cfg.train.param_dtype,
            activation_checkpointing=cfg.train.activation_checkpointing, source=source,
            scaler=LossScaler.of(cfg.train), whole=cfg.train.optimizer == "muon",
        ))
        self.scaler = self.parallelized.scaler  # fp16's; None otherwise
        self.compiled = 0  # blocks whose forward is compiled (`train.compile`)
        if compile_enabled(cfg.train.compile, device):
            self.compiled = apply_compile(self.parallelized.module, cfg.train.compile_backend,
                                          loss_fn=self.parallelized.loss_fn)
        del model  # its pieces live in the chunks now; other stages' layers are let go
        self.model = self.parallelized.module  # this rank's chunks, single-device names
        self.optimizer = build_for(self.parallelized, cfg.train)
        self.resumed_from = find(cfg.checkpoint.resume, cfg.checkpoint.dir)
        history, changed = mixture_history(cfg.data, self.resumed_from)
        if changed and dist.get_rank() == 0:
            print(f"plait: note: {changed}", file=sys.stderr)
        self.data = open_data(cfg.data, cfg.train.seed, args.vocab_size, history,
                              cfg.train.global_batch)
        # The ranks that split the batch: its rows over dp x ep (expert parallelism's ranks route
        # their own tokens), each row's sequence over cp (`context`).
        batch = self.parallelized.axes["batch"]
        self.dp_group, self.pp_group = batch.group, mesh["pp"].get_group()
        self.dp, self.dims = batch.size, dims
        self.rows_rank, self.rows = rows_share(self.parallelized.axes)
        self.context = self.parallelized.context
        self.tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        self.n_params = n_params
        self.activations = SavedActivations(self.model)
        shape = cfg.model.shape()  # routing metrics: plait's MoE's (an HF one's logs none)
        self.moe = RouterMetrics(dataclasses.replace(shape, experts=0) if cfg.model.hf else shape,
                                 self.model, self.pp_group, device)
        self.world = world_axis()  # every rank: the step's FLOP count, --verify, the trace
        self.is_logger = self.world.rank == 0
        self.checkpoints = Checkpointer(cfg, {MIXTURE: history} if history else None)
        self.start_step = 0  # optimizer steps already done (a resumed run's checkpoint's)
        if self.resumed_from is not None:
            self.start_step = load(self.resumed_from, self.parallelized, self.optimizer,
                                   self.checkpoints.group)
            # The checkpoint keeps one generator (rank 0's): each rank's own streams again.
            seed_ranks(self.parallelized.axes, cfg.parallel.sequence_parallel)

    def _global_mean(self, value: float) -> float:
        """Mean over the dp x cp x ep ranks of a per-rank mean (every rank holds equally many
        tokens); the loss exists on the last pipeline stage only, so it is summed over pp first
        (the other stages contribute 0)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        all_reduce(t, self.pp_group)
        all_reduce(t, self.dp_group)
        return t.item() / self.dp

    def train_step(self, step: int) -> dict:
        """One optimizer step over the global batch; returns this rank's local results."""
        self.model.train()
        # Both: under ZeRO the optimizer owns slices, not the model's parameters.
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        # A step skipped for an fp16 overflow does not advance the schedule (loss_scaling.py).
        lr = lr_at(step - (self.scaler.skipped if self.scaler else 0), self.train_cfg)
        set_lr(self.optimizer, lr)
        self.moe.clear()
        waited = time.perf_counter()
        batch = self.data.batch(step, self.train_cfg.global_batch, self.rows_rank, self.rows,
                                self.microbatches)  # (inputs, targets[, documents])
        waited = time.perf_counter() - waited
        with self.activations:  # peak bytes saved for backward during the step
            loss_sum, norm = self.parallelized.step(self._microbatches(*batch),
                                                    self.optimizer, self.train_cfg.grad_clip)
        if not self._steady:
            # What lives for the run (optimizer state, ZeRO's reused buffers, DDP's gradient
            # buckets) was made in its own mappings; from now on what a step makes and frees
            # is served from the heap, for reuse (`plait/host_memory.py`).
            release_freed_memory(STEADY_THRESHOLD)
            self._steady = True
        result = {"loss": loss_sum, "lr": lr, "activation_bytes": self.activations.peak,
                  "grad_norm": norm, "skipped": not math.isfinite(norm), "data_wait_s": waited}
        # Under fp16 a non-finite norm is the loss scale's business (an overflow: skipped, the
        # scale backed off), unless the loss itself is not finite: then it is nan_policy's. The
        # loss's reduction runs only on skipped steps.
        overflow = result["skipped"] and self.scaler is not None and \
            math.isfinite(self._global_mean(loss_sum))
        if result["skipped"] and not overflow and self.train_cfg.nan_policy == "stop":
            raise NonFiniteGradient(
                f"step {step}: the gradient norm is {norm}, not finite; "
                f"likely causes: a learning rate too high for this model (train.lr = "
                f"{self.train_cfg.lr}, {lr:.3g} at this step), or bad data (data.source); "
                "train.nan_policy = 'skip' drops such steps' updates instead")
        return result

    def _microbatches(self, inputs, targets, documents=None) -> list[tuple]:
        return self.parallelized.split(inputs, targets, self.microbatches, documents)

    def validate(self) -> dict:
        """`val_loss`; with a mixture also each source's own, on its validation split alone
        (`val_loss/<name>`)."""
        return {f"val_loss{suffix}": self.evaluate(data)
                for suffix, data in self.data.validation_sets()}

    @torch.no_grad()
    def evaluate(self, data=None) -> float:
        """The mean loss of `eval_batches` validation batches of `data` (the run's by default)."""
        data = self.data if data is None else data
        self.model.eval()
        total = 0.0
        for i in range(self.train_cfg.eval_batches):
            batch = data.val_batch(
                i, self.train_cfg.global_batch, self.rows_rank, self.rows, self.microbatches
            )
            total += self.parallelized.pipeline_eval.run(self._microbatches(*batch))
        return self._global_mean(total / self.train_cfg.eval_batches)

    def _rates(self) -> tuple[float, float]:
        """(one device's peak FLOP/s, the model FLOPs of a step), found by rank 0 and broadcast:
        measuring a CPU while the other ranks compute on the same cores would measure the
        contention, and the model's FLOPs are one trace of it whole (`model_flops`: what
        FlopCounterMode counts of its forward and backward on the global batch), not one per
        rank."""
        peak = flops = 0.0
        if self.is_logger:
            peak = peak_flops(self.device, self.train_cfg.peak_tflops)
            try:
                flops = model_flops(self.cfg)
            except Exception as e:  # noqa: BLE001 -- a diagnostic never stops a run
                # Untraceable: the step reads values; anything else: torch's counter failed on
                # an operation (torch 2.11's on grouped-query attention did). 6N + attention
                # (Kaplan; PaLM) instead.
                flops = self.tokens_per_step * flops_per_token(
                    self.cfg.model.shape(), self.n_params, self.cfg.data.seq_len)
                if not isinstance(e, Untraceable):
                    print(f"plait: note: the FLOP count (torch's FlopCounterMode) failed "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                          "MFU uses 6N + attention's FLOPs per token instead", file=sys.stderr)
        t = torch.tensor([peak, flops], dtype=torch.float64, device=self.device)
        broadcast(t, src=0, group=self.world.group)
        return t[0].item(), t[1].item()

    def verify(self) -> Verdict:
        """One step of this layout against one of the whole model in this process, from the same
        weights and global batch (`train/verify.py`); nothing is updated."""
        cfg = self.train_cfg
        inputs, targets, *documents = self.data.batch(0, cfg.global_batch)
        local = self.data.batch(0, cfg.global_batch, self.rows_rank, self.rows, self.microbatches)
        self.model.train()
        compute = contextlib.nullcontext()
        if cfg.precision in HALF:
            compute = torch.autocast(self.device.type, dtype=HALF[cfg.precision])
        with compute:  # the reference's forward as the layout computes its own
            return verify_step(self.parallelized, self.reference.train(),
                               self._microbatches(*local), inputs.to(self.device),
                               targets.to(self.device), cross_entropy, self._global_mean,
                               2e-2 if cfg.precision in HALF else 1e-4, self.world,
                               documents[0].to(self.device) if documents else None)

    def fit(self, outputs: Outputs | None = None) -> Summary:
        """Train from `start_step` until `train.steps` or `train.stop_after` steps are done,
        saving checkpoints when `checkpoint.dir` is set."""
        cfg, summary, outputs = self.train_cfg, Summary(), outputs or Outputs()
        last = min(cfg.steps, cfg.stop_after or cfg.steps)
        peak, summary.flops_per_step = self._rates()
        peak *= dist.get_world_size()
        writer = MetricsWriter(outputs.metrics if self.is_logger else None,
                               outputs.tensorboard if self.is_logger else None,
                               append=self.start_step > 0)
        progress = Progress(cfg.steps, enabled=outputs.progress and self.is_logger,
                            start=self.start_step)
        traced = range(0)
        if outputs.trace:
            traced = traced_steps(last - self.start_step, outputs.trace_steps, self.start_step)
        times, comm = [], []
        for step in range(self.start_step, last):
            self.checkpoints.poll()
            maybe_fail("step", step)
            result, elapsed, ledger = self._timed_step(step, step in traced)
            times.append(elapsed)
            if step == self.start_step and self.compiled and self.is_logger:
                self._say_compiled(elapsed)
            comm.append(ledger["bytes"])
            mfu = summary.flops_per_step / elapsed / peak
            record = self._record(step, result, elapsed, ledger, summary, mfu)
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < last:
                record.update(self.validate())
            if step + 1 == last:
                record.update(self.validate())
                summary.val_loss = record["val_loss"]
            writer.write(record)
            progress.update(step, record["loss"], record["tokens_per_s"], record.get("val_loss"))
            if self.checkpoints.due(step + 1, last):
                self.checkpoints.save(step + 1, self.parallelized, self.optimizer)
        self.checkpoints.wait()
        progress.close()
        writer.close()
        if outputs.trace:
            finish_trace(outputs.trace, self.dims, self.world)
        # The first step pays one-off costs (allocations, warm caches): leave it out of rates.
        steady = statistics.median(times[1:] or times)
        summary.tokens_per_s = self.tokens_per_step / steady
        summary.mfu = summary.flops_per_step / steady / peak
        summary.comm_bytes_per_step = statistics.mean(comm)
        summary.model_state_bytes = self.parallelized.state_bytes(self.optimizer)
        summary.loss_scale = self.scaler.scale if self.scaler is not None else 0.0
        return summary

    def _say_compiled(self, first_step_s: float) -> None:
        """One line after the first step: what was compiled, and what dynamo left eager."""
        breaks, first = graph_breaks()
        eager = f"; {breaks} graph break(s) run eager (first: {first})" if breaks else ""
        print(f"plait: note: train.compile: {self.compiled} block(s) compiled "
              f"({self.train_cfg.compile_backend}; the first step, compiling included, took "
              f"{first_step_s:.1f} s){eager}", file=sys.stderr)

    def _timed_step(self, step: int, traced: bool) -> tuple[dict, float, dict]:
        """One training step: its result, its seconds and its collectives (the ledger's
        snapshot: the step's training traffic, before any logging reduction)."""
        LEDGER.reset()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        if traced:  # the step's own work: not the logging and validation after it
            TRACER.start(dist.get_rank())
        start = time.perf_counter()
        with TRACER.span(f"step {step}", STEP, step=step):
            result = self.train_step(step)
            if cuda:
                torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        TRACER.pause()
        # The device's own count of the step's peak (None on the CPU, which keeps none).
        result["gpu_mem_allocated_peak"] = torch.cuda.max_memory_allocated(self.device) \
            if cuda else None
        result["gpu_mem_reserved_peak"] = torch.cuda.max_memory_reserved(self.device) \
            if cuda else None
        return result, elapsed, LEDGER.snapshot()

    def _record(self, step: int, result: dict, elapsed: float, ledger: dict, summary: Summary,
                mfu: float) -> dict:
        """The step's metrics line (rank 0 writes it); the loss, skips and routing also go into
        the run's summary."""
        cfg = self.train_cfg
        loss = self._global_mean(result["loss"])
        state = self.parallelized.state_bytes(self.optimizer)
        summary.losses.append(loss)
        summary.skipped_steps += result["skipped"]
        record = {
            "step": step,
            "loss": loss,
            "lr": result["lr"],
            "grad_norm": result["grad_norm"],  # before clipping (unscaled under fp16)
            "tokens": self.tokens_per_step * (step + 1),
            **self.data.metrics(step + 1, cfg.global_batch),  # epoch (per source: mixture.py)
            "step_time_s": elapsed,
            "tokens_per_s": self.tokens_per_step / elapsed,
            "mfu": mfu,
            "comm_bytes": ledger["bytes"],
            "comm_calls": ledger["calls"],
            "comm_wait_s": ledger["wait_s"],  # blocked in collectives: the exposed part
            "data_wait_s": result["data_wait_s"],  # reading this rank's rows of the batch
            "model_state_bytes": state,
            "activation_bytes": result["activation_bytes"],
            # What plait's counts say the step's peak is (model state at its peak in the step
            # plus the activations kept for backward: the numbers --dry-run and the planner
            # predict), beside what the device measured.
            "mem_predicted_peak": state["peak"] + result["activation_bytes"],
            "gpu_mem_allocated_peak": result["gpu_mem_allocated_peak"],
            "gpu_mem_reserved_peak": result["gpu_mem_reserved_peak"],
        }
        summary.gpu_mem_allocated_peak = max(summary.gpu_mem_allocated_peak or 0,
                                             result["gpu_mem_allocated_peak"] or 0) or None
        summary.gpu_mem_reserved_peak = max(summary.gpu_mem_reserved_peak or 0,
                                            result["gpu_mem_reserved_peak"] or 0) or None
        summary.mem_predicted_peak = max(summary.mem_predicted_peak, record["mem_predicted_peak"])
        if self.scaler is not None:  # the whole run's, resumes included
            record["loss_scale"] = self.scaler.scale
            record["skipped_steps"] = self.scaler.skipped
        elif cfg.nan_policy == "skip":
            record["skipped_steps"] = summary.skipped_steps
        if self.moe.layers is not None:
            record["moe"] = self.moe.step()
            summary.moe.append(record["moe"])
        return record
