"""transformers' Mixtral: Llama's attention; the feed-forward a mixture of experts (`mlp`: a top-k
router `mlp.gate` and the experts `mlp.experts`, their weights stacked by expert), which expert
parallelism splits by expert. tp splits the attention alone: the mixture runs whole on each tp
rank (its gradients are then whole there too; under sp each rank's token shard's part)."""

from __future__ import annotations

from plait.model.families.family import Family
from plait.model.families.llama import LLAMA_LIKE
from plait.model.plan import ModelPlan

FAMILY = Family("hf-mixtral", ("MixtralForCausalLM",), ModelPlan(
    family="hf-mixtral",
    **{**LLAMA_LIKE,
       "tp_splits": {k: v for k, v in LLAMA_LIKE["tp_splits"].items()
                     if k.startswith("self_attn.")},
       "tp_halves": ("self_attn",),
       "tp_divides": ("num_attention_heads", "num_key_value_heads", "vocab_size"),
       "recompute": ("input_layernorm", "post_attention_layernorm")},
    moe_experts="mlp.experts",
))
