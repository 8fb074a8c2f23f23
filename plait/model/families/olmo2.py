"""transformers' OLMo2: the Llama-shaped attention and MLP, with norms after them rather than
before (`post_attention_layernorm`, `post_feedforward_layernorm`, on each half's output before
the residual), and RMSNorms over the whole of q and of k (`self_attn.q_norm`, `k_norm`: all heads
at once, not per head). tp splits those two by heads with q and k, and sums their squares over
tp (`ModelPlan.tp_norms`)."""

from __future__ import annotations

from plait.model.families.family import Family
from plait.model.families.llama import LLAMA_LIKE
from plait.model.plan import ModelPlan

FAMILY = Family("hf-olmo2", ("Olmo2ForCausalLM",), ModelPlan(
    family="hf-olmo2",
    **{**LLAMA_LIKE,
       "recompute": ("post_attention_layernorm", "post_feedforward_layernorm", "mlp.act_fn")},
    tp_norms=("self_attn.q_norm", "self_attn.k_norm"),
))
