"""transformers' Llama-shaped decoders: Llama, Mistral, Qwen2, Qwen3, Gemma. Each decoder layer
is attention then a gated MLP, each behind a norm:

    self_attn: q_proj, k_proj, v_proj split by heads (output rows; with their biases, Qwen2)
               -> o_proj by heads (input columns); Qwen3's q_norm / k_norm act per head
    mlp:       gate_proj, up_proj split by hidden units (rows) -> down_proj (columns)

Gemma scales its embeddings by sqrt(hidden_size) in its embedding module, which the
vocabulary-parallel embedding keeps (`plait/parallel/vocab_parallel.py`)."""

from __future__ import annotations

from plait.model.families.family import Family
from plait.model.plan import ModelPlan

LLAMA_LIKE = dict(
    blocks="layers",
    first=("embed_tokens",),
    last=("norm", "lm_head"),
    shared=("rotary_emb", "positions", "loss_function", "family"),
    hidden_size="hidden_size",
    vocab_size="vocab_size",
    tp_splits={
        "self_attn.q_proj": 0, "self_attn.k_proj": 0, "self_attn.v_proj": 0,
        "self_attn.o_proj": 1, "mlp.gate_proj": 0, "mlp.up_proj": 0, "mlp.down_proj": 1,
    },
    tp_halves=("self_attn", "mlp"),
    tp_divides=("num_attention_heads", "num_key_value_heads", "intermediate_size",
                "vocab_size"),
    vocab_embedding="embed_tokens",
    vocab_head="lm_head",
    attention_core="self_attn.core",
    positions="positions",
    recompute=("input_layernorm", "post_attention_layernorm", "mlp.act_fn"),
)

FAMILIES = [
    Family(family, (arch,), ModelPlan(family=family, **LLAMA_LIKE))
    for arch, family in (("LlamaForCausalLM", "hf-llama"), ("MistralForCausalLM", "hf-mistral"),
                         ("Qwen2ForCausalLM", "hf-qwen2"), ("Qwen3ForCausalLM", "hf-qwen3"),
                         ("GemmaForCausalLM", "hf-gemma"))
]
