"""The checks of a Hugging Face model folder (`model.hf`, `plait convert --from hf`), before any
worker: what its files say without torch (config.json, safetensors headers), then what needs
transformers' reading of it, and the degrees against its family's plan (`HF_PLANS`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from plait.config.schema import Config, ConfigError
from plait.mesh import ParallelDims
from plait.model.families import Family, family_for, family_of
from plait.model.hf_config import HF_PLANS, architecture, hf_args, read_config
from plait.model.plan import tp_misfit


def check_hf(cfg: Config, dims: ParallelDims) -> None:
    """A Hugging Face folder: readable, its family's plan has what the degrees need, and nothing
    the layout cannot represent (tied embeddings split apart, a sliding window shorter than the
    sequence under cp). What config.json says alone is checked first, without torch (a refusal in a
    fraction of a second); then what needs transformers' reading of it."""

    raw = read_hf_folder(cfg.model.hf)
    arch, family = architecture(raw), family_for(raw)
    plan = family.plan if family is not None else None
    fields = {"num_key_value_heads": raw.get("num_attention_heads"), **raw}
    # A family with no plan needs none of its fields; a planned one, those tp divides, as
    # written (whole numbers).
    early = bool(arch) and (plan is None or all(type(fields.get(k)) is int
                                                for k in plan.tp_divides))
    if early:
        _check_planned(dims, arch, family, SimpleNamespace(**fields))
    config = transformers_config(Path(cfg.model.hf), raw)
    if not early:
        arch = arch or config.model_type
        _check_planned(dims, arch, family, config)
    if cfg.model.attention == "sdpa":
        # here, not at the top: transformers' modeling classes import torch, only for this key
        from plait.model.hf import supports_sdpa

        if not supports_sdpa(config):
            raise ConfigError("model.attention", f"transformers computes {arch} with its own "
                              "attention only (no SDPA); use 'auto' or 'eager'")
    if cfg.parallel.wrap and not cfg.parallel.wrap.isdigit():
        _check_wrap_classes(arch, config.model_type, cfg.parallel.wrap)
    if family is not None and "position_embeddings" in family.modules and \
            cfg.data.document_mask:
        raise ConfigError("data.document_mask", f"{arch} adds learned positions to its "
                          "embeddings, which would not restart at each document; set it to false")
    if plan is None and cfg.data.document_mask:
        raise ConfigError("data.document_mask", f"{arch} has no plait plan (planned: "
                          f"{', '.join(HF_PLANS)}), and its attention takes no document mask "
                          "from plait; set it to false")
    if plan is None and cfg.train.activation_checkpointing == "selective":
        raise ConfigError("train.activation_checkpointing", f"{arch} has no plait plan naming "
                          "its attention core; 'full' recomputes each decoder layer")
    if plan is None and cfg.train.activation_checkpointing == "full" and \
            not _decoder_layers(arch, config.model_type):
        raise ConfigError("train.activation_checkpointing", f"{arch} names no decoder layer "
                          "(transformers' _no_split_modules) to recompute; set it to 'none'")
    # Pipeline stages put the embedding and the head apart (tp splits both by vocabulary rows
    # alike and keeps them one; ZeRO-3 makes them one unit).
    tied = getattr(config, "tie_word_embeddings", False)
    if tied and dims.pp > 1:
        raise ConfigError("parallel.pp", "the model ties its input embedding and output head "
                          "(tie_word_embeddings), which pipeline stages would hold apart; set "
                          "pp = 1, or use a model with tie_word_embeddings = false")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < cfg.data.seq_len \
            and dims.cp > 1:
        raise ConfigError("parallel.cp", f"data.seq_len {cfg.data.seq_len} exceeds the model's "
                          f"sliding window ({window}), which plait's context-parallel kernels "
                          f"do not apply; set cp = 1, or seq_len <= {window}")


def _modeling(model_type: str):
    """The family's modeling module, where transformers keeps it under its model type's name;
    None where it does not (then the worker says what is wrong, building the model)."""
    # here, not at the top: transformers' modeling modules import torch, only for the keys
    # that need them
    import importlib

    try:
        return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return None


def _check_wrap_classes(arch: str, model_type: str, wrap: str) -> None:
    """`parallel.wrap`'s class names against the family's modeling module (`_modeling`)."""
    module = _modeling(model_type)
    if module is None:
        return
    missing = [n.strip() for n in wrap.split(",") if not isinstance(getattr(module, n.strip(),
                                                                            None), type)]
    if missing:
        layers = getattr(getattr(module, arch, None), "_no_split_modules", None) or []
        raise ConfigError("parallel.wrap", f"{arch} has no module class {', '.join(missing)}"
                          + (f"; its decoder layer is {', '.join(layers)}" if layers else ""))


def _decoder_layers(arch: str, model_type: str) -> list[str]:
    """The classes transformers names in `arch`'s `_no_split_modules` (its decoder layer: what
    "full" recomputes and ZeRO-3 makes its units, `PlainCausalLM.unit_classes`); a module that
    does not import is given the benefit of the doubt (the worker names what is missing)."""
    module = _modeling(model_type)
    if module is None:
        return ["?"]
    return list(getattr(getattr(module, arch, None), "_no_split_modules", None) or [])


def _check_planned(dims: ParallelDims, arch: str, family: Family | None,
                   fields: object) -> None:
    """The degrees against the family's plan: an axis that needs a plan, tp dividing what it
    splits (read from `fields`), a config of the family an axis cannot run (`Family.refused`),
    ep needing experts."""

    plan = family.plan if family is not None else None
    for axis in ("tp", "pp", "cp", "ep"):
        if getattr(dims, axis) > 1 and plan is None:
            raise ConfigError(f"parallel.{axis}", f"{arch} has no plait plan (planned: "
                              f"{', '.join(HF_PLANS)}{_unplanned(arch, fields)}); it trains "
                              f"with dp and ZeRO-1/2/3: set {axis} = 1")
    misfit = plan and tp_misfit(plan, fields, dims.tp)
    if misfit:
        raise ConfigError("parallel.tp", misfit)
    if plan is not None and dims.cp > 1 and plan.attention_core is None:
        raise ConfigError("parallel.cp", f"{arch}'s attention computes itself (SDPA called in "
                          "its module), where plait's context-parallel kernels cannot go; set "
                          "cp = 1")
    for refusal in family.refused if family is not None else ():
        if getattr(dims, refusal.axis) > 1 and refusal.applies(fields):
            raise ConfigError(f"parallel.{refusal.axis}", f"{arch} with {refusal.key} set "
                              f"({refusal.what}) {REFUSED[refusal.axis]}; set "
                              f"{refusal.axis} = 1")
    if plan is not None and dims.ep > 1 and plan.moe is None and plan.moe_experts is None:
        raise ConfigError("parallel.ep", f"{arch} has no mixture-of-experts layers; set ep = 1")


# What each axis cannot do for a config a family refuses (`Family.refused`).
REFUSED = {"tp": "has layers plait's plan does not split by tp",
           "cp": "computes an attention plait's context-parallel kernels do not"}


def _unplanned(arch: str, fields: object) -> str:
    """Why a planned family has no plan for this config (`Family.unplanned_when`), or ""."""
    family = family_of(arch)
    keys = [k for k in family.unplanned_when if getattr(fields, k, None)] if family else []
    return f", but not with {', '.join(keys)} set" if keys else ""


def check_hf_folder(where: str) -> tuple[dict, object]:
    """A `model.hf` folder that transformers' save_pretrained wrote for a causal LM: its
    config.json as JSON and as transformers reads it."""
    raw = read_hf_folder(where)
    return raw, transformers_config(Path(where), raw)


def read_hf_folder(where: str) -> dict:
    """What a `model.hf` folder's files say without torch or transformers: a config.json that
    is a JSON object asking for no code of its own and giving the model's shape, and whole
    safetensors files."""
    folder = Path(where)
    if not (folder / "config.json").is_file():
        raise ConfigError("model.hf", f"{folder} has no config.json; give a folder that "
                          "transformers' save_pretrained wrote")

    try:
        raw = read_config(folder)
    except ValueError as e:
        raise ConfigError("model.hf", f"{folder}/config.json: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError("model.hf", f"{folder}/config.json holds no JSON object")
    if raw.get("auto_map"):
        raise ConfigError("model.hf", f"{folder}/config.json asks for the folder's own code "
                          "(auto_map), which plait does not run; give a model transformers "
                          "implements")
    check_safetensors(folder)
    try:
        hf_args(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError("model.hf", f"{folder}/config.json: {e}".splitlines()[0]) from None
    return raw


def transformers_config(folder: Path, raw: dict) -> object:
    """The folder's config as transformers reads it, for a causal language model it knows."""
    try:
        # here, not at the top: transformers only for a Hugging Face model
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError("model.hf", "needs the transformers package: pip install "
                          "transformers") from None
    _check_causal_lm(folder, raw)
    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError("model.hf", f"{folder}/config.json: {e}".splitlines()[0]) from None


def check_safetensors(folder: Path, key: str = "model.hf") -> set[str]:
    """Each weights file's header reads and covers the file (safetensors checks both on open):
    a truncated or corrupted one crashed the workers (`model.hf`) or `plait convert --from hf`
    (`key`, the argument that named the folder). Returns the names of the folder's tensors."""
    # here, not at the top: safetensors only for a Hugging Face folder
    from safetensors import SafetensorError, safe_open

    names = set()
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(path, "numpy") as file:  # the header check, without importing torch
                names.update(file.keys())
        except (SafetensorError, OSError) as e:
            raise ConfigError(key, f"{path} is not a whole safetensors file ({e}); copy it "
                              "again") from None
    return names


def _check_causal_lm(folder: Path, raw: dict) -> None:
    """A causal language model that transformers knows, with no code of its own to run: an
    encoder (BERT's masked LM) would train with a fresh head and no causal mask, silently."""
    # here, not at the top: transformers only for a Hugging Face model
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )


    where = f"{folder}/config.json"
    kind = raw.get("model_type")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError("model.hf", f"{where}: model_type {kind!r} is not a causal language "
                          "model transformers knows (AutoModelForCausalLM); give a decoder such "
                          "as Llama, Qwen, Mistral, Mixtral or GPT-2")
    arch = architecture(raw)
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    encoder = kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not raw.get("is_decoder")
    if arch and arch not in causal and arch.endswith("ForCausalLM"):
        raise ConfigError("model.hf", f"{where}: architectures names {arch}, a class this "
                          f"transformers does not have (model_type {kind!r} builds "
                          f"{MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind]}); give that class, or a "
                          "transformers version that has it")
    if (arch and arch not in causal) or encoder:
        raise ConfigError("model.hf", f"{where}: {arch or kind} is an encoder or another head, "
                          "not a causal language model (it would train without a causal mask); "
                          "give a decoder such as Llama, Qwen, Mistral, Mixtral or GPT-2")
