"""Configuration: one typed dataclass per component, TOML files, `section.key=value` overrides.

Every check that can be made before a worker starts is made in `plait.train.checks.validate`,
and raises `ConfigError(field, fix)`; the CLI turns it into exit status 2 and one line.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from plait.mesh import AXES, ParallelDims  # noqa: F401 - AXES is re-exported
from plait.model.args import PRESETS, ModelArgs
from plait.model.hf_config import hf_args, hf_shape, read_config
from plait.model.shape import Shape

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """Bad input, found before any worker starts. `field` is the dotted key at fault."""

    def __init__(self, field: str, fix: str):
        super().__init__(f"{field}: {fix}")
        self.field = field


@dataclass
class ModelConfig:
    """`preset` names a size in `plait.model.PRESETS`; any other key overrides one of its fields.
    `hf` names a Hugging Face model folder instead (`plait/model/hf.py`), whose config.json
    decides the shape."""

    preset: str = "tiny"
    overrides: dict[str, Any] = field(default_factory=dict)
    hf: str = ""
    # The Hugging Face model's attention: "auto" (SDPA where transformers has it for the family,
    # else the family's own eager attention), "sdpa" or "eager".
    attention: str = "auto"

    def args(self) -> ModelArgs:
        """plait's Llama's sizes (a Hugging Face model's, read into the same fields)."""
        if self.hf:
            return hf_args(read_config(self.hf))
        return dataclasses.replace(PRESETS[self.preset], **self.overrides)

    def shape(self) -> Shape:
        """What the formulas read of the model, whichever family (`plait/model/shape.py`)."""
        if self.hf:  # read once per folder and version of its config.json
            return _hf_shape(self.hf, self.version())
        return Shape.of_llama(self.args())

    def version(self) -> int:
        """Which version of the model's folder this names (its config.json's mtime; 0 for a
        preset): what a count cached per model keys on besides `key()`."""
        return (Path(self.hf) / "config.json").stat().st_mtime_ns if self.hf else 0

    def key(self) -> tuple:
        """The model this section names, hashable (for what builds it once per model)."""
        return (self.preset, tuple(sorted(self.overrides.items())), self.hf, self.attention)

    def __hash__(self) -> int:  # the planner caches what it builds per model (never mutated)
        return hash(self.key())

    def build(self, seed: int, device="cpu"):
        """The model whole (`plait.model.build_configured`; on `meta`: shapes alone)."""
        # here, not at the top: the model's modules import torch; the checks read this module
        from plait.model import build_configured

        return build_configured(self.args(), seed, device, self.hf, self.attention)

    def build_sharded(self, seed: int, device="cpu"):
        """(the model with its parameters on `meta`, the source its ranks materialize their
        parts from: `plait.model.build_sharded`)."""
        # here, not at the top: the model's modules import torch; the checks read this module
        from plait.model import build_sharded

        return build_sharded(self.args(), seed, device, self.hf, self.attention)


@functools.lru_cache(maxsize=64)
def _hf_shape(folder: str, version: int) -> Shape:
    return hf_shape(read_config(folder))


@dataclass
class ParallelConfig:
    """Degrees of the mesh axes (`dp = 0` means: whatever the world size leaves), and how the data
    parallelism communicates."""

    dp: int = 0
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    cp_method: str = "ring"  # context parallelism: "ring" (attention) | "ulysses" (all-to-all)
    sequence_parallel: bool = False  # with tp > 1: norms and residual on sequence shards
    zero: int = 0  # ZeRO stage of the data parallelism: 0 (plain DDP), 1, 2, 3 (FSDP)
    dp_shard: int = 0  # under ZeRO: shard over groups of this many dp ranks (HSDP); 0 = all of dp
    wrap: str = ""  # ZeRO-3's units: class names ("GPT2Block,Other") or a parameter count (each
    # module holding that many); "": a plan's blocks, else a transformers family's own
    # `_no_split_modules` (one unit per decoder layer), else the whole model one unit
    unused_parameters: bool = False  # a parameter no gradient reaches in a step: zero gradient
    # (DDP's find_unused_parameters) instead of an error naming it
    reshard_after_forward: bool = True  # ZeRO-3: free each unit after use (False: keep it whole
    # from its first use in a step to its gradient reduction, one gather per step)
    max_live_params: int = 0  # ZeRO-3: prefetch a unit only while the gathered parameters stay
    # within this many elements (DeepSpeed's stage3_max_live_parameters); 0: no bound
    reduce_dtype: str = "fp32"  # ZeRO gradient reductions: "fp32", or train.precision's half dtype
    offload: str = "none"  # ZeRO on a GPU: "optimizer" or "params" (stage 3) in host memory
    pp_schedule: str = "1f1b"  # "gpipe" | "1f1b" | "interleaved" | "zb1"
    microbatches: int = 0  # micro-batches per step and dp rank (accumulation); 0 = pp
    pp_virtual: int = 2  # model chunks per stage under the interleaved schedule
    pp_split: list[int] = field(default_factory=list)  # layers per chunk; empty = balanced
    bucket_mb: float = 25.0  # gradient bucket size
    allreduce: str = "backend"  # "backend" | "ring" | "naive" | "hierarchical"
    ranks_per_node: int = 0  # processes per node (hierarchical all-reduce, --dry-run's nodes); 0:
    # the launcher's LOCAL_WORLD_SIZE (torchrun's --nproc-per-node), else the whole world
    compression: str = "none"  # of the dp gradient reduction: plait/comm/compression/ METHODS
    compression_ratio: float = 0.01  # topk: fraction of each tensor's elements sent
    compression_rank: int = 4  # powersgd: rank of the approximation
    compression_start: int = 0  # optimizer steps reduced uncompressed first
    timeout_s: float = 300.0  # a collective not done by then ends the job, naming the late ranks


@dataclass
class TrainConfig:
    steps: int = 100
    stop_after: int = 0  # end cleanly after this many steps (0: run all `steps`); LR as for `steps`
    global_batch: int = 32  # sequences per optimizer step, over all data-parallel ranks
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    lr_scaling: str = "none"  # "linear": lr * global_batch / base_batch (Goyal et al. 2017)
    base_batch: int = 32
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    # "adamw" | "muon" (Muon for the blocks' matrices, AdamW for the rest; optim/muon.py) |
    # "sgd" (with momentum)
    optimizer: str = "adamw"
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    # "match_rms_adamw" (Moonlight: Muon reuses AdamW's lr and weight decay) | "original"
    # (Keller Jordan's sqrt(max(1, rows / cols)), which wants a larger lr: muon_lr_ratio)
    muon_adjust_lr: str = "match_rms_adamw"
    muon_lr_ratio: float = 1.0  # the matrices' lr is train.lr times this
    sgd_momentum: float = 0.9
    seed: int = 0
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16" (autocast; fp32 weights and optimizer
    # state; fp16 with loss scaling, plait/optim/loss_scaling.py)
    # The parameters' dtype under a half precision (FSDP2's param_dtype): "auto" (the half
    # dtype under ZeRO, fp32 under DDP and one device) | "fp32" | train.precision's half dtype
    # (held and computed in it under every engine, fp32 masters stepped, fp32 reductions)
    param_dtype: str = "auto"
    loss_scale: str | float = "dynamic"  # fp16: "dynamic", or a static scale (a number)
    loss_scale_init: float = 65536.0  # the dynamic scale's start, 2^16
    loss_scale_growth_interval: int = 2000  # clean steps in a row before the scale doubles
    loss_scale_hysteresis: int = 1  # overflows tolerated before the scale halves (1: at once)
    loss_scale_min: float = 1.0  # a dynamic scale falling below this stops the run
    eval_every: int = 0  # steps between validation passes; 0 = only after the last step
    eval_batches: int = 4
    threads: int = 1  # intra-op threads per worker: oversubscribed cores are ruinous
    activation_checkpointing: str = "none"  # "none" | "full" | "selective"
    device: str = "auto"  # "auto" (cuda if there is one) | "cpu" | "cuda"
    nan_policy: str = "stop"  # a non-finite gradient norm: "stop" the run, or "skip" the update
    peak_tflops: float = 0.0  # per device, for MFU; 0 = known GPU table, or measured on CPU
    # Each block's forward through torch.compile (plait/parallel/compile.py): true | false |
    # "auto" (on for CUDA, off on the CPU)
    compile: bool | str = "auto"
    compile_backend: str = "inductor"  # torch.compile's backend ("aot_eager": no code generated)


@dataclass
class DataConfig:
    # "stdlib" (Python's own .py files), a text file or folder (bytes are tokens), a uint16 .bin,
    # or a folder written by `plait data prepare` (data/corpus.py)
    source: str = "stdlib"
    seq_len: int = 64
    val_fraction: float = 0.05  # of the documents (whole), or of the tokens of a single document
    max_bytes: int = 0  # train on the first bytes of `source` only (said when it cuts); 0: all
    # A weighted mixture of prepared folders instead of `source` (data/mixture.py): each
    # {path = "...", weight = 0.7, name = "web"} (name: the folder's own unless given)
    sources: list[dict] = field(default_factory=list)
    # Attention stops at document boundaries within a window, and positions restart at each
    # document (model/documents.py); needs a source whose documents are known
    document_mask: bool = False


def folder_name(path: str) -> str:
    """A mixture source's name where its entry gives none: its folder's."""
    return path.rstrip("/").rsplit("/", 1)[-1]


@dataclass
class CheckpointConfig:
    dir: str = ""  # where checkpoints go; "" saves none
    every: int = 0  # steps between saves; 0: only when the run ends or stops (train.stop_after)
    keep: int = 2  # newest complete checkpoints kept; older ones are deleted
    async_: bool = False  # `checkpoint.async`: written in the background; training waits only for
    # the copy into memory
    resume: str = "auto"  # "auto": the newest complete checkpoint in dir | "never" | a path


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        model = out.pop("model")
        chosen = {} if model["attention"] == "auto" else {"attention": model["attention"]}
        out["model"] = {"hf": model["hf"], **chosen} if model["hf"] else \
            {"preset": model["preset"], **model["overrides"]}
        out["checkpoint"][ASYNC] = out["checkpoint"].pop("async_")
        return out


SECTIONS = ("model", "parallel", "train", "data", "checkpoint")
ASYNC = "async"  # a Python keyword: the attribute is `async_`

# Keys that were replaced: the one-line message names the replacement.
REPLACED = {
    "train.micro_batch": "replaced by parallel.microbatches, the one notion of micro-batch: "
    "micro-batches per step and data-parallel rank (global_batch / dp / micro_batch)",
}


def microbatches(par: ParallelConfig, dims: ParallelDims) -> int:
    """Micro-batches per step and data-parallel rank: the pipeline's, or accumulation's."""
    return par.microbatches or dims.pp


def at_world(cfg: Config, n: int, first: int, weak: bool) -> Config:
    """The recipe at n ranks (`bench scaling`): dp takes what the other degrees leave; under
    weak scaling the global batch grows with n from the first size's."""
    batch = cfg.train.global_batch * n // first if weak else cfg.train.global_batch
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=0),
                               train=dataclasses.replace(cfg.train, global_batch=batch))


def with_cp(cfg: Config, cp: int, method: str) -> Config:
    """The recipe over cp ranks by `method`, one sequence per step (`bench cp`)."""
    par = dataclasses.replace(cfg.parallel, cp=cp, cp_method=method, dp=1)
    return dataclasses.replace(cfg, parallel=par)


def cp_variants(degrees: list[int], methods: list[str]) -> list[tuple[int, str]]:
    """`bench cp`'s runs: one rank (the reference), then each degree > 1 by each method."""
    return [(1, "ring")] + [(c, m) for c in degrees if c > 1 for m in methods]


def clip_warmup(cfg: Config) -> tuple[Config, str | None]:
    """A run shorter than its warm-up gets the warm-up clipped to the run, and a note saying so."""
    train = cfg.train
    if train.steps < 1 or train.warmup_steps <= train.steps:
        return cfg, None
    note = (f"train.warmup_steps={train.warmup_steps} is longer than train.steps={train.steps}; "
            f"warm-up clipped to {train.steps} steps")
    return dataclasses.replace(cfg, train=dataclasses.replace(train, warmup_steps=train.steps)), \
        note


def parse_override(text: str) -> tuple[str, Any]:
    """`section.key=value`; the value is read as a TOML value, else kept as a plain string."""
    key, sep, raw = text.partition("=")
    if not sep or "." not in key:
        raise ConfigError(text, "overrides are written section.key=value, e.g. train.steps=20")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the TOML file, then the command-line overrides, each key type-checked."""
    raw: dict[str, dict[str, Any]] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("--config", f"no file {path}; pass an existing TOML file")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("--config", f"{path} is not valid TOML ({e})") from None
        except UnicodeDecodeError:
            raise ConfigError("--config", f"{path} is not UTF-8 text; pass a TOML file") from None
    for name, value in raw.items():
        if name not in SECTIONS or not isinstance(value, dict):
            raise ConfigError(name, f"unknown section; sections are {', '.join(SECTIONS)}")
    if any(parse_override(text)[0] == "model.hf" for text in overrides):
        raw.pop("model", None)  # the folder replaces the file's model (a recipe's preset)
    for text in overrides:
        key, value = parse_override(text)
        section, _, name = key.partition(".")
        if section not in SECTIONS:
            known = ", ".join(SECTIONS)
            raise ConfigError(key, f"unknown section '{section}'; sections are {known}")
        raw.setdefault(section, {})[name] = value
    return Config(
        model=model_section(raw.get("model", {})),
        **{s: _section(s, raw.get(s, {})) for s in SECTIONS if s != "model"},
    )


def _section(name: str, values: dict[str, Any]):
    cls = _hints(Config)[name]
    values = {("async_" if k == ASYNC else k): v for k, v in values.items()}
    return cls(**{k: _typed(f"{name}.{k.rstrip('_')}", v, _hints(cls), cls)
                  for k, v in values.items()})


ATTENTIONS = ("auto", "sdpa", "eager")  # model.attention


def model_section(values: dict[str, Any]) -> ModelConfig:
    """The `model` section from its keys (a file's, or a checkpoint's plait.json)."""
    if "hf" in values:
        hf, others = values["hf"], sorted(k for k in values if k not in ("hf", "attention"))
        if not isinstance(hf, str) or not hf:
            raise ConfigError("model.hf", "the path of a Hugging Face model folder, as a string")
        if others:
            raise ConfigError(f"model.{others[0]}", "the folder's config.json decides the model "
                              "with model.hf; drop this key")
        attention = values.get("attention", ModelConfig.attention)
        if attention not in ATTENTIONS:
            raise ConfigError("model.attention", f"one of {', '.join(ATTENTIONS)}, not "
                              f"{attention!r}")
        return ModelConfig(hf=hf, attention=attention)
    if "attention" in values:
        raise ConfigError("model.attention", "chooses a Hugging Face model's attention (with "
                          "model.hf); plait's Llama computes its own: drop this key")
    preset = values.get("preset", ModelConfig.preset)
    if preset not in PRESETS:
        raise ConfigError("model.preset", f"unknown preset '{preset}'; one of {', '.join(PRESETS)}")
    hints = _hints(ModelArgs)
    overrides = {
        k: _typed(f"model.{k}", v, hints, ModelArgs) for k, v in values.items() if k != "preset"
    }
    return ModelConfig(preset=preset, overrides=overrides)


@functools.cache
def _hints(cls) -> dict[str, type]:
    """Each field's type. Evaluated once per class: the annotations are strings, and evaluating
    them per key had been most of a refusal's time (70 of 100 ms)."""
    every = get_type_hints(cls)
    return {f.name: every[f.name] for f in dataclasses.fields(cls)}


def _typed(key: str, value: Any, hints: dict[str, type], cls) -> Any:
    name = key.split(".", 1)[1]
    name = "async_" if name == ASYNC else name
    if key in REPLACED:
        raise ConfigError(key, REPLACED[key])
    if name not in hints:
        known = ", ".join(n.rstrip("_") for n in hints if n != "overrides")
        raise ConfigError(key, f"unknown key; {key.split('.')[0]} keys are {known}")
    want = hints[name]
    if get_origin(want) in (Union, types.UnionType):  # str | float: a word or a number
        words = [t for t in get_args(want) if t is not float]
        if isinstance(value, bool) and bool not in words or \
                not isinstance(value, (int, float, *words)):
            raise ConfigError(key, f"expected a word or a number, got {value!r}")
        want = type(value) if isinstance(value, tuple(words)) else float
    if get_origin(want) is list:
        item = get_args(want)[0]
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            kind = "integers" if item is int else "tables ({path = ..., weight = ...})"
            raise ConfigError(key, f"expected a list of {kind}, got {value!r}")
        return value
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(key, f"expected {want.__name__}, got {value!r}")
    return value
