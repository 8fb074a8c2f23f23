"""The checks of the `train` section (with fp16's loss scale, the compiler and the optimizer), made
before a worker starts; `plait.config.checks_layout.check_layout` calls them after the model's and
the layout's. Each raises `ConfigError(field, fix)`; none imports torch (a device check aside)."""

from __future__ import annotations

from importlib.metadata import entry_points

from plait.config.choices import (
    COMPILE_BACKEND_ENTRY_POINTS,
    COMPILE_BACKENDS,
    HALF_PRECISIONS,
    MUON_ADJUST_LR,
    OPTIMIZERS,
    PARAM_DTYPES,
)
from plait.config.schema import ConfigError, TrainConfig
from plait.mesh import ParallelDims


def _has_cuda() -> bool:
    # here, not at the top: the checks before launch import no torch (tests/unit/test_config.py)
    import torch  # only for train.device = "cuda": a refusal of anything else needs no torch

    return torch.cuda.is_available()


def check_train(train: TrainConfig, dims: ParallelDims) -> None:
    if train.steps < 1:
        raise ConfigError("train.steps", f"must be >= 1, got {train.steps}")
    if not 0 <= train.warmup_steps <= train.steps:
        raise ConfigError("train.warmup_steps", f"must be in [0, train.steps={train.steps}]")
    if train.device == "cuda" and not _has_cuda():
        raise ConfigError("train.device", "no CUDA device here; use 'auto' or 'cpu'")
    if train.lr <= 0:
        raise ConfigError("train.lr", f"must be > 0, got {train.lr}")
    for name, low, high in (("beta1", 0.0, 1.0), ("beta2", 0.0, 1.0)):
        value = getattr(train, name)
        if not low <= value < high:
            raise ConfigError(f"train.{name}", f"must be in [{low:g}, {high:g}), got {value}")
    if not 0 <= train.min_lr_ratio <= 1:
        raise ConfigError("train.min_lr_ratio", f"must be in [0, 1], got {train.min_lr_ratio}")
    for name in ("weight_decay", "grad_clip", "peak_tflops"):
        if getattr(train, name) < 0:
            raise ConfigError(f"train.{name}", f"must be >= 0, got {getattr(train, name)}")
    if train.base_batch < 1:
        raise ConfigError("train.base_batch", f"must be >= 1, got {train.base_batch}")
    if train.eval_every < 0:
        raise ConfigError("train.eval_every", f"must be >= 0 (0: after the last step only), "
                          f"got {train.eval_every}")
    if train.eval_batches < 1:
        raise ConfigError("train.eval_batches", f"must be >= 1, got {train.eval_batches}")
    _check_precision(train)
    _check_loss_scale(train)
    if train.lr_scaling not in ("none", "linear"):
        raise ConfigError("train.lr_scaling", f"'none' or 'linear', got '{train.lr_scaling}'")
    if not 0 <= train.stop_after <= train.steps:
        raise ConfigError("train.stop_after", f"a step count in [0, train.steps={train.steps}] "
                          f"(0: run them all), got {train.stop_after}")
    if train.threads < 1:
        raise ConfigError("train.threads", f"must be >= 1, got {train.threads}")
    if train.activation_checkpointing not in ("none", "full", "selective"):
        raise ConfigError("train.activation_checkpointing",
                          f"'none', 'full' or 'selective', got '{train.activation_checkpointing}'")
    _check_compile(train)
    if train.device not in ("auto", "cpu", "cuda"):
        raise ConfigError("train.device", f"'auto', 'cpu' or 'cuda', got '{train.device}'")
    if train.nan_policy not in ("stop", "skip"):
        raise ConfigError("train.nan_policy", f"'stop' or 'skip', got '{train.nan_policy}'")
    _check_optimizer(train)
    if train.global_batch < 1 or train.global_batch % dims.rows:
        ranks = f"dp={dims.dp}" + (f" x ep={dims.ep}" if dims.ep > 1 else "")
        raise ConfigError(
            "train.global_batch",
            f"{train.global_batch} must be a positive multiple of {ranks}",
        )


def _check_precision(train: TrainConfig) -> None:
    """`train.precision` and `train.param_dtype`."""
    if train.precision == "fp8":
        raise ConfigError("train.precision", "'fp8' is priced by plait plan only (the linear "
                          "layers' matmuls at a device's fp8 rate); the engine trains in 'fp32', "
                          "'bf16' or 'fp16'")
    if train.precision not in ("fp32", *HALF_PRECISIONS):
        raise ConfigError("train.precision",
                          f"'fp32', 'bf16' or 'fp16', got '{train.precision}'")
    if train.param_dtype not in PARAM_DTYPES:
        raise ConfigError("train.param_dtype", f"'auto', 'fp32', 'bf16' or 'fp16', got "
                          f"'{train.param_dtype}'")
    if train.param_dtype in HALF_PRECISIONS and train.param_dtype != train.precision:
        raise ConfigError("train.param_dtype", f"'{train.param_dtype}' parameters compute in "
                          f"train.precision's dtype, which is '{train.precision}': set "
                          f"train.precision='{train.param_dtype}' too, or use 'auto'")


def _check_loss_scale(train: TrainConfig) -> None:
    """`train.loss_scale*`: fp16's (plait/optim/loss_scaling.py)."""
    scale = train.loss_scale
    if isinstance(scale, str) and scale != "dynamic":
        raise ConfigError("train.loss_scale", f"'dynamic' or a positive number, got '{scale}'")
    if not isinstance(scale, str) and scale <= 0:
        raise ConfigError("train.loss_scale", f"a static scale must be > 0, got {scale:g} "
                          "(DeepSpeed's 0 for a dynamic scale is 'dynamic' here)")
    if not isinstance(scale, str) and train.precision != "fp16":
        raise ConfigError("train.loss_scale", "loss scaling is for train.precision = 'fp16' "
                          f"(this run is '{train.precision}'): leave it at 'dynamic'")
    for key, ok, want in (
            # fp16's largest value is 65504: a scale beyond 2^24 only halves for steps on end
            ("init", 0 < train.loss_scale_init <= 2.0**24, "must be in (0, 2^24 = 16777216]"),
            ("growth_interval", train.loss_scale_growth_interval >= 1, "must be >= 1 step"),
            ("hysteresis", train.loss_scale_hysteresis >= 1, "must be >= 1 (1: back off at once)"),
            ("min", 0 < train.loss_scale_min <= train.loss_scale_init,
             f"must be in (0, train.loss_scale_init={train.loss_scale_init:g}]")):
        if not ok:
            value = getattr(train, f"loss_scale_{key}")
            raise ConfigError(f"train.loss_scale_{key}", f"{want}, got {value}")


def _check_compile(train: TrainConfig) -> None:
    if not isinstance(train.compile, bool) and train.compile != "auto":
        raise ConfigError("train.compile", f"true, false or 'auto', got {train.compile!r}")
    if train.compile is not False and train.compile_backend != "inductor":
        known = compile_backends()
        if train.compile_backend not in known:
            raise ConfigError("train.compile_backend", f"one of torch.compile's backends "
                              f"({', '.join(known)}), got '{train.compile_backend}'")


def compile_backends() -> list[str]:
    """The names `train.compile_backend` may take: torch's own and those packages register."""
    plugins = entry_points(group=COMPILE_BACKEND_ENTRY_POINTS)
    return sorted({*COMPILE_BACKENDS, *(plugin.name for plugin in plugins)})


def _check_optimizer(train: TrainConfig) -> None:
    if train.optimizer not in OPTIMIZERS:
        raise ConfigError("train.optimizer", f"one of {', '.join(OPTIMIZERS)}, got "
                          f"'{train.optimizer}'")
    for name in ("muon_momentum", "sgd_momentum"):
        value = getattr(train, name)
        if not 0 <= value < 1:
            raise ConfigError(f"train.{name}", f"must be in [0, 1), got {value}")
    if not 1 <= train.muon_ns_steps < 100:
        raise ConfigError("train.muon_ns_steps", f"Newton-Schulz iterations in [1, 99], got "
                          f"{train.muon_ns_steps}")
    if train.muon_adjust_lr not in MUON_ADJUST_LR:
        raise ConfigError("train.muon_adjust_lr", f"one of {', '.join(MUON_ADJUST_LR)}, got "
                          f"'{train.muon_adjust_lr}'")
    if not 0 < train.muon_lr_ratio <= 1e3:  # beyond, the first update overflows
        raise ConfigError("train.muon_lr_ratio", f"must be in (0, 1000], got "
                          f"{train.muon_lr_ratio}")
