"""transformers' Starcoder2: the Llama-shaped attention with biases on every projection, a plain
MLP (c_fc -> gelu -> c_proj, with biases), LayerNorms. The row-parallel o_proj and c_proj keep
their biases whole, added once in the sum over tp (`plait/parallel/tensor_parallel.py`)."""

from __future__ import annotations

from plait.model.families.family import Family
from plait.model.families.llama import LLAMA_LIKE
from plait.model.plan import ModelPlan

FAMILY = Family("hf-starcoder2", ("Starcoder2ForCausalLM",), ModelPlan(
    family="hf-starcoder2",
    **{**LLAMA_LIKE,
       "tp_splits": {"self_attn.q_proj": 0, "self_attn.k_proj": 0, "self_attn.v_proj": 0,
                     "self_attn.o_proj": 1, "mlp.c_fc": 0, "mlp.c_proj": 1},
       "recompute": ("input_layernorm", "post_attention_layernorm", "mlp.act")},
), mlp="plain")
