"""A Hugging Face model folder's config.json, read without torch: its architecture, its shape
as plait's `ModelArgs`, and the plans of the families plait splits (`HF_PLANS`, from
`plait/model/families/`). The checks that refuse a bad `model.hf` read only this module (and
safetensors' headers), so a refusal takes a fraction of a second, not the seconds of importing
torch and transformers' models (`plait/model/hf.py` builds and runs the model)."""

from __future__ import annotations

import json
from pathlib import Path

from plait.model.args import ModelArgs
from plait.model.families import FAMILIES, family_for
from plait.model.shape import Shape

# The plans of the families plait splits, by architecture (`plait/model/families/`).
HF_PLANS = {arch: family.plan for arch, family in FAMILIES.items()}


def read_config(folder: str | Path) -> dict:
    """config.json of a Hugging Face model folder, as JSON (nothing is imported or run)."""
    path = Path(folder) / "config.json"
    return json.loads(path.read_text())


def architecture(config: dict) -> str:
    names = config.get("architectures") or []
    return names[0] if names else ""


NO_POSITION_LIMIT = 2**31 - 1  # a model whose positions are relative biases (ALiBi)


def _reader(config: dict):
    """field(*names, default): the first of config.json's `names` it gives, else `default`;
    with no default, a KeyError naming them."""

    def field(*names, default=None):
        for name in names:
            if config.get(name) is not None:
                return config[name]
        if default is None:
            raise KeyError(f"config.json has none of {', '.join(names)}")
        return default

    return field


def hf_shape(config: dict) -> Shape:
    """The `Shape` of a transformers model, from its config.json (the names families give each
    size), and its family's kind of MLP (`Family.mlp`; a family with no plan: by its activation,
    gated for SiLU). Raises KeyError naming a missing config field."""
    args, field = hf_args(config), _reader(config)
    family = family_for(config)
    act = str(field("hidden_act", "hidden_activation", "activation_function", default=""))
    mlp = family.mlp if family else "gated" if "silu" in act or "swish" in act else "plain"
    alibi = config.get("model_type") == "bloom" or bool(config.get("alibi"))
    return Shape(
        hidden=args.dim, layers=args.n_layers, heads=args.n_heads, kv_heads=args.n_kv_heads,
        head_dim=int(field("head_dim", default=args.dim // args.n_heads)), ffn=args.ffn_dim,
        vocab=args.vocab_size, max_positions=args.max_seq_len, experts=args.moe_experts,
        top_k=args.moe_top_k,
        norm="rms" if any("rms_norm" in k for k in config) else "layer", mlp=mlp,
        tied=bool(config.get("tie_word_embeddings", True)),
        attention="alibi" if alibi else "causal", norm_eps=args.norm_eps,
        rope_theta=args.rope_theta)


def hf_args(config: dict) -> ModelArgs:
    """The shape of a transformers model as plait's `ModelArgs` (what the checks of its degrees
    read): width, layers, heads, vocabulary, positions, MLP hidden units. Raises KeyError
    naming a missing config field."""
    field = _reader(config)
    dim = field("hidden_size", "n_embd", "d_model")
    heads = field("num_attention_heads", "n_head")
    rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    kv_heads = field("num_key_value_heads", "num_kv_heads", default=heads)
    if config.get("multi_query") and not config.get("new_decoder_architecture"):
        kv_heads = 1  # Falcon's multi-query attention: one key/value head, whatever it names
    return ModelArgs(
        dim=dim, n_layers=field("num_hidden_layers", "n_layer"), n_heads=heads,
        n_kv_heads=kv_heads,
        vocab_size=field("vocab_size"),
        # ALiBi's families (BLOOM) bias the scores by distance and name no length: no limit.
        max_seq_len=field("max_position_embeddings", "n_positions", default=NO_POSITION_LIMIT
                          if config.get("model_type") == "bloom" or config.get("alibi")
                          else None),
        intermediate_size=field("intermediate_size", "n_inner", "ffn_hidden_size", default=4 * dim),
        norm_eps=float(field("rms_norm_eps", "layer_norm_epsilon", default=1e-5)),
        rope_theta=float(rope or 10000.0),
        moe_experts=int(config.get("num_local_experts") or config.get("num_experts") or 0),
        moe_top_k=int(config.get("num_experts_per_tok") or 2),
    )


def has_weights(folder: str | Path) -> bool:
    folder = Path(folder)
    return (folder / "model.safetensors").is_file() or \
        (folder / "model.safetensors.index.json").is_file()
