"""transformers' Phi3: the Llama-shaped decoder with q, k and v in one projection (`qkv_proj`) and
the gate and up projections in one (`gate_up_proj`), each held as one linear per part
(`Family.fused`), which tp splits by rows like Llama's. Its attention cuts q from k and v by the
config's head count (`self_attn.config.num_attention_heads`), which each tp rank divides on its
attention's own copy of the config (`tp_heads`)."""

from __future__ import annotations

from plait.model.families.family import Family
from plait.model.families.llama import LLAMA_LIKE
from plait.model.plan import ModelPlan

FAMILY = Family(
    "hf-phi3", ("Phi3ForCausalLM",),
    ModelPlan(family="hf-phi3", **{
        **LLAMA_LIKE,
        "tp_splits": {"self_attn.qkv_proj.parts.*": 0, "self_attn.o_proj": 1,
                      "mlp.gate_up_proj.parts.*": 0, "mlp.down_proj": 1},
        "recompute": ("input_layernorm", "post_attention_layernorm", "mlp.activation_fn")},
        tp_heads=("self_attn.num_key_value_heads", "self_attn.config.num_attention_heads")),
    fused={"self_attn.qkv_proj": ("num_attention_heads", "num_key_value_heads",
                                  "num_key_value_heads"),
           "mlp.gate_up_proj": ("intermediate_size", "intermediate_size")},
)
