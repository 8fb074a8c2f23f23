"""What a Hugging Face Llama folder is to plait's Llama, read without torch: the names of its
tensors, the settings of its config.json, and what plait's Llama cannot represent. `plait convert
--from hf` checks a folder with these before importing torch (a refusal takes a fraction of a
second); checkpoint/hf.py converts the tensors with them."""

from __future__ import annotations

import re

from plait.model.args import ModelArgs

# plait name -> Hugging Face name; {i} is a layer index.
NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
}
ROTATED = ("attention.wq.weight", "attention.wk.weight")
BUFFERS = ("rotary_emb.inv_freq",)  # a buffer older exports carry; plait computes it


def rename(name: str, table: dict[str, str]) -> str:
    for src, dst in table.items():
        pattern = "^" + re.escape(src).replace(r"\{i\}", r"(\d+)") + "$"
        m = re.match(pattern, name)
        if m:
            return dst.replace("{i}", m.group(1)) if m.groups() else dst
    raise KeyError(f"no Hugging Face Llama name for {name}")


def hf_config(args: ModelArgs) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def unrepresentable(hf: dict) -> str | None:
    """Why plait's Llama cannot compute what the Hugging Face model in config `hf` computes, or
    None: another architecture, rotary scaling (`rope_scaling` / `rope_parameters` with a
    `rope_type` other than "default", as Llama 3.1 and later have), biases, an activation other
    than SiLU, a sliding window."""
    arch = (hf.get("architectures") or [None])[0]
    if arch != "LlamaForCausalLM" and not (arch is None and hf.get("model_type") == "llama"):
        return f"architectures is {arch or hf.get('model_type')}, not LlamaForCausalLM"
    for key in ("rope_scaling", "rope_parameters"):
        kind = (hf.get(key) or {}).get("rope_type") or (hf.get(key) or {}).get("type")
        if kind not in (None, "default"):
            return f"{key} has rope_type {kind!r}, which plait's rotary embedding does not scale"
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            return f"{key} is true; plait's Llama has no biases"
    if hf.get("hidden_act", "silu") != "silu":
        return f"hidden_act is {hf['hidden_act']!r}; plait's Llama uses SiLU"
    return None


def model_overrides(hf: dict) -> dict:
    """The `model.*` settings of a Hugging Face Llama config (ValueError if plait's Llama cannot
    represent it)."""
    why = unrepresentable(hf)
    if why is not None:
        raise ValueError(f"{why}; train the folder as itself instead: plait train "
                         "model.hf=DIR")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim", dim // heads) != dim // heads:
        raise ValueError(f"head_dim {hf['head_dim']} != hidden_size / heads: plait derives it")
    theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return {"dim": dim, "n_layers": hf["num_hidden_layers"], "n_heads": heads,
            "n_kv_heads": hf.get("num_key_value_heads", heads), "vocab_size": hf["vocab_size"],
            "intermediate_size": hf["intermediate_size"],
            "max_seq_len": hf["max_position_embeddings"], "norm_eps": hf["rms_norm_eps"],
            "rope_theta": float(theta)}


def names_problem(names: set[str], hf: dict) -> str | None:
    """Why tensors under `names` are not the Llama that config `hf` describes, or None: a name no
    Llama has, or one of its tensors missing. (The shapes are checked on the model once built.)"""
    back = {v: k for k, v in NAMES.items()}
    for name in sorted(names):
        try:
            if not name.endswith(BUFFERS):
                rename(name, back)
        except KeyError:
            return f"tensor {name!r} is not a Llama's (its safetensors hold another model)"
    layers = range(hf["num_hidden_layers"])
    want = {name.replace("{i}", str(i)) for name in NAMES.values() for i in layers}
    if hf.get("tie_word_embeddings"):
        want.discard("lm_head.weight")
    missing = sorted(want - names)
    if missing:
        return (f"its safetensors lack {len(missing)} tensor(s) of the model config.json "
                f"describes ({missing[0]}, ...)")
    return None
