"""The checks of a run's own sections, `train` (with fp16's loss scale), `data` and `checkpoint`,
made before a worker starts; `plait.checks.validate` calls them after the model's and the
layout's. Each raises `ConfigError(field, fix)`."""

from __future__ import annotations

import os
import re
from importlib.metadata import entry_points
from pathlib import Path

from plait.choices import (
    COMPILE_BACKEND_ENTRY_POINTS,
    COMPILE_BACKENDS,
    HALF_PRECISIONS,
    MUON_ADJUST_LR,
    OPTIMIZERS,
    PARAM_DTYPES,
)
from plait.config import Config, ConfigError, DataConfig, TrainConfig, model_section
from plait.mesh import ParallelDims
from plait.model.args import ModelArgs


def _has_cuda() -> bool:
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
    """`train.loss_scale*`: fp16's (plait/parallel/loss_scaling.py)."""
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


def check_data(data: DataConfig, args: ModelArgs) -> None:
    if not 1 <= data.seq_len <= args.max_seq_len:
        raise ConfigError(
            "data.seq_len",
            f"must be in [1, model.max_seq_len={args.max_seq_len}], got {data.seq_len}",
        )
    if not 0 < data.val_fraction < 1:
        raise ConfigError("data.val_fraction", f"must be in (0, 1), got {data.val_fraction}")
    if data.max_bytes < 0:
        raise ConfigError("data.max_bytes", f"must be >= 0 (0: all of data.source), got "
                          f"{data.max_bytes}")
    if data.source != "stdlib" and not Path(data.source).exists():
        raise ConfigError("data.source", f"no such file or folder '{data.source}'; or use 'stdlib'")
    if data.sources:
        _check_sources(data)


def _check_sources(data: DataConfig) -> None:
    """`data.sources`: tables of a path, a weight and maybe a name, the names distinct."""
    from plait.train.mixture import folder_name  # numpy's import: only for a mixture
    if data.source != "stdlib":
        raise ConfigError("data.sources", "a mixture replaces data.source: set one of them")
    if data.max_bytes:
        raise ConfigError("data.max_bytes", "cuts data.source; a mixture's sources are whole "
                          "(set it to 0, or weigh the sources)")
    names = set()
    for i, entry in enumerate(data.sources):
        key = f"data.sources[{i}]"
        unknown = sorted(set(entry) - {"path", "weight", "name"})
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}", "unknown key; a source has path, weight "
                              "and name")
        path, weight = entry.get("path"), entry.get("weight")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{key}.path", "the folder plait data prepare wrote, as a string")
        # Bounded so that any number of them sums to a finite total (the draw divides by it).
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not 0 < weight <= 1e6:
            raise ConfigError(f"{key}.weight", f"a number in (0, 1e6] (the weights need not sum "
                              f"to 1), got {weight!r}")
        name = entry.get("name", folder_name(path))
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ConfigError(f"{key}.name", f"letters, digits, '_', '.' or '-' (it names the "
                              f"source's metrics, epoch/<name>), got {name!r}")
        if name in names:
            raise ConfigError(f"{key}.name", f"'{name}' names two sources; give each its own "
                              "name")
        names.add(name)


def check_checkpoint(cfg: Config) -> None:
    ck = cfg.checkpoint
    if ck.every < 0:
        raise ConfigError("checkpoint.every", f"must be >= 0 steps (0: at the end), got {ck.every}")
    if ck.keep < 1:
        raise ConfigError("checkpoint.keep", f"must be >= 1, got {ck.keep}")
    if ck.every and not ck.dir:
        raise ConfigError("checkpoint.every", "saving needs checkpoint.dir, a folder to save in")
    if ck.dir:
        where = Path(ck.dir)
        while not where.exists() and where != where.parent:
            where = where.parent
        if not where.is_dir() or not os.access(where, os.W_OK):
            raise ConfigError("checkpoint.dir", f"cannot write in {where}; choose another folder")
    from plait.checkpoint import find

    source = find(ck.resume, ck.dir)  # a path given as `resume` is looked in alone
    if ck.resume not in ("auto", "never") and source is None:
        raise ConfigError("checkpoint.resume", f"no complete checkpoint at {ck.resume}; give a "
                          "checkpoint folder (with COMPLETE) or a folder of them, 'auto' or "
                          "'never'")
    if source is None:
        return
    from plait.checkpoint import BadMeta, read_meta

    try:  # plait.json first, read without torch: a checkpoint of another model is refused fast
        held = model_section(dict(read_meta(source, model=True)["config"]["model"]))
    except BadMeta as e:
        raise ConfigError("checkpoint.resume", f"{e}; resume from a checkpoint you trust, or set "
                          "checkpoint.resume='never'") from None
    ours = _weights_signature(cfg.model.args())
    differ = {k: v for k, v in _weights_signature(held.args()).items() if ours[k] != v}
    if differ:
        key, value = next(iter(differ.items()))
        raise ConfigError("checkpoint.resume", f"{source} holds a model with {key}={value}, "
                          f"this run's has {key}={ours[key]}; resume with the same model "
                          "settings, or set checkpoint.resume='never'")
    # Imported here: torch.distributed.checkpoint takes seconds to import, which every refusal
    # and every command that validates a configuration would pay otherwise.
    from plait.checkpoint.metadata import UnsafeCheckpoint, check_checkpoint

    try:
        check_checkpoint(source)
    except (UnsafeCheckpoint, BadMeta) as e:
        raise ConfigError("checkpoint.resume", f"{e}; resume from a checkpoint you trust, "
                          "or set checkpoint.resume='never'") from None


def _weights_signature(args: ModelArgs) -> dict:
    """What a checkpoint's weights fix: their shapes, and the numbers the forward uses them with."""
    keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "norm_eps",
            "rope_theta")
    return {k: getattr(args, k) for k in keys}


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
