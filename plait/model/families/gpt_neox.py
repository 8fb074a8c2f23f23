"""transformers' GPT-NeoX (Pythia): attention and MLP side by side on the residual stream
(`use_parallel_residual`) or one after the other, LayerNorms, biases everywhere, under
`gpt_neox.` rather than `model.`:

    attention: query_key_value (each head's q, k, v rows together, heads in order) split by
               heads (rows) -> dense by heads (columns; its bias added once in the sum over tp)
    mlp:       dense_h_to_4h split by hidden units (rows) -> dense_4h_to_h (columns)

Its embeddings pass the model's dropout (`emb_dropout`) before the first layer."""

from __future__ import annotations

from plait.model.families.family import Family
from plait.model.plan import ModelPlan

FAMILY = Family(
    "hf-gpt-neox", ("GPTNeoXForCausalLM",),
    ModelPlan(
        family="hf-gpt-neox",
        blocks="layers",
        first=("embed_tokens", "embed_dropout"),
        last=("norm", "lm_head"),
        shared=("rotary_emb", "positions", "loss_function", "family"),
        tp_splits={"attention.query_key_value": 0, "attention.dense": 1,
                   "mlp.dense_h_to_4h": 0, "mlp.dense_4h_to_h": 1},
        tp_halves=("attention", "mlp"),
        tp_divides=("num_attention_heads", "intermediate_size", "vocab_size"),
        vocab_embedding="embed_tokens",
        vocab_head="lm_head",
        attention_core="attention.core",
        positions="positions",
        recompute=("input_layernorm", "post_attention_layernorm", "mlp.act"),
    ),
    modules={"embed_tokens": "gpt_neox.embed_in", "embed_dropout": "gpt_neox.emb_dropout",
             "layers": "gpt_neox.layers", "norm": "gpt_neox.final_layer_norm",
             "rotary_emb": "gpt_neox.rotary_emb", "lm_head": "lm_head"},
    mlp="plain",
)
