"""What a step cost: FLOPs and MFU, model-state bytes, routing, and the JSONL metrics file."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import torch

from plait.comm import all_reduce
from plait.model.shape import Shape
from plait.parallel.expert_parallel import moe_layers
from plait.planner.calibrate import measure_cpu_flops
from plait.planner.hardware import known_device


def flops_per_token(shape: Shape, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls of forward + backward (Kaplan et al. 2020), N
    counting every parameter but the input embedding (a lookup, not a matmul) and but the experts
    a token is not routed to (a mixture of experts activates top_k of E), plus
    12 * layers * seq * dim for the attention scores and their weighted sum (PaLM, Chowdhery et al.
    2022, appendix B)."""
    n = n_params - shape.vocab * shape.hidden - inactive_expert_params(shape)
    return 6 * n + 12 * shape.layers * seq_len * shape.hidden


def inactive_expert_params(shape: Shape) -> int:
    """Parameters of the experts a token does not go through: E - top_k per MoE block, each
    expert's MLP 3 (gated) or 2 matrices of hidden x ffn."""
    moe_blocks = sum(shape.is_moe(i) for i in range(shape.layers))
    matrices = 3 if shape.mlp == "gated" else 2
    return moe_blocks * (shape.experts - shape.top_k) * matrices * shape.hidden * shape.ffn


def peak_flops(device: torch.device, configured_tflops: float) -> float:
    """Peak FLOP/s of one device: the configured value, else the planner's device table (dense
    bf16 or fp16, datasheets: `planner.hardware.DEVICES`), else measured."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type == "cuda":

        found = known_device(torch.cuda.get_device_name(device))
        if found is not None:
            return found.peak_flops

    return measure_cpu_flops()


class MetricsWriter:
    """One JSON object per line (the contract); optionally every number in it also as a
    TensorBoard scalar, nested keys joined by "/" (`model_state_bytes/params`). Only the rank
    that owns it writes."""

    def __init__(self, path: str | None, tensorboard_dir: str | None = None,
                 append: bool = False):
        """`append`: a resumed run continues its metrics file."""
        self._file = self._board = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a" if append else "w")  # noqa: SIM115 - held for the run
        if tensorboard_dir:
            # here, not at the top: tensorboard only with --tensorboard
            from torch.utils.tensorboard import SummaryWriter

            self._board = SummaryWriter(tensorboard_dir)

    def write(self, record: dict) -> None:
        """Strict JSON: a non-finite number (a skipped step's loss) is written as null."""
        if self._file:
            clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                     for k, v in record.items()}
            self._file.write(json.dumps(clean, allow_nan=False) + "\n")
            self._file.flush()
        if self._board:
            for tag, value in _scalars(record):
                self._board.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._board:
            self._board.close()


def _scalars(record: dict, prefix: str = ""):
    """(tag, value) for every finite number of a metrics record, nested dicts flattened."""
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, dict):
            yield from _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, int | float) and not isinstance(value, bool) \
                and math.isfinite(value):
            yield prefix + key, value


class RouterMetrics:
    """Each step's routing in every mixture-of-experts layer, for the metrics' `moe` entry: the
    load-balancing and z losses, the fraction of tokens dropped, and the busiest expert's load
    (assignments kept) over the mean, per layer and over the layers (mean; worst for the load).
    The layers' statistics already cover the whole batch; those of other pipeline stages are
    summed in over pp (a logging reduction after the step, outside its comm_bytes)."""

    def __init__(self, shape: Shape, chunks, pp_group, device: torch.device):
        self.ids = [i for i in range(shape.layers) if shape.is_moe(i)]
        self.layers = {int(i): m for chunk in chunks.values()
                       for i, m in moe_layers(chunk).items()} if self.ids else None
        self.experts, self.group, self.device = shape.experts, pp_group, device

    def clear(self) -> None:
        """Before a step: forget the last one's routing."""
        for layer in (self.layers or {}).values():
            layer.stats.clear()
            getattr(layer.dispatch, "rows", []).clear()

    def step(self) -> dict:
        """The step's metrics (every rank calls it: it reduces over pp). A layer recomputed by
        activation checkpointing routes the same tokens again: means are unchanged."""
        t = torch.zeros(len(self.ids), 3 + self.experts, dtype=torch.float64, device=self.device)
        for row, i in enumerate(self.ids):
            stats = self.layers.get(i) and self.layers[i].stats
            if stats:
                t[row, 0] = statistics.fmean(s.aux_loss for s in stats)
                t[row, 1] = statistics.fmean(s.z_loss for s in stats)
                t[row, 2] = statistics.fmean(s.dropped for s in stats)
                t[row, 3:] = torch.stack([s.kept for s in stats]).mean(0)
        all_reduce(t, self.group)
        layers = {}
        for row, i in enumerate(self.ids):
            load = t[row, 3:]
            layers[str(i)] = {"aux_loss": t[row, 0].item(), "z_loss": t[row, 1].item(),
                              "dropped": t[row, 2].item(),
                              "max_load": (load.max() / load.mean()).item(),
                              "load": load.tolist()}
        return {key: (max if key == "max_load" else statistics.fmean)(
                    layer[key] for layer in layers.values())
                for key in ("aux_loss", "z_loss", "dropped", "max_load")} | {"layers": layers}
