"""transformers' Falcon with rotary positions: LayerNorms, attention and MLP side by side on the
residual stream (`parallel_attn`; under `new_decoder_architecture` each behind a LayerNorm of its
own), under `transformer.` rather than `model.`:

    self_attention: query_key_value split by rows: its rows are grouped per key/value head (each
                    group's queries, then its key and value: new_decoder_architecture) or per
                    head (q, k, v: multi_query false), so a contiguous slice is whole groups
                    -> dense by heads (columns)
    mlp:            dense_h_to_4h by hidden units (rows) -> dense_4h_to_h (columns)

Its attention calls SDPA itself (`Family.own_attention`): cp is refused, and the layers get the
mask it needs. One key/value head shared by every query head (`multi_query` without the new
architecture) would be copied to every tp rank: tp is refused for it. With ALiBi (`alibi`, the
RW models) it trains as a family with no plan."""

from __future__ import annotations

from plait.model.families.family import Family, Refusal
from plait.model.plan import ModelPlan

LINEARS = ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h",
           "mlp.dense_4h_to_h")

FAMILY = Family(
    "hf-falcon", ("FalconForCausalLM",),
    ModelPlan(
        family="hf-falcon",
        blocks="layers",
        first=("embed_tokens",),
        last=("norm", "lm_head"),
        shared=("rotary_emb", "positions", "loss_function", "family"),
        hidden_size="hidden_size",
        vocab_size="vocab_size",
        tp_splits=dict(zip(LINEARS, (0, 1, 0, 1), strict=True)),
        tp_halves=("self_attention", "mlp"),
        tp_divides=("num_attention_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size"),
        tp_heads=("self_attention.num_heads", "self_attention.num_kv_heads"),
        vocab_embedding="embed_tokens",
        vocab_head="lm_head",
        positions="positions",
        recompute=("input_layernorm", "post_attention_layernorm", "ln_attn", "ln_mlp",
                   "mlp.act"),
    ),
    modules={"embed_tokens": "transformer.word_embeddings", "layers": "transformer.h",
             "norm": "transformer.ln_f", "rotary_emb": "transformer.rotary_emb",
             "lm_head": "lm_head"},
    mlp="plain",
    refused=(Refusal("tp", "multi_query", "one key/value head shared by every query head, which "
                     "tp would copy to every rank", unless="new_decoder_architecture"),),
    unplanned_when=("alibi",),
    plain_linears=LINEARS,
    own_attention=True,
    layer_kwargs={"alibi": None},
    layer_returns_tuple=True,
)
