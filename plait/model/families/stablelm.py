"""transformers' StableLM: the Llama-shaped decoder with LayerNorms (weights and biases), rotary
embeddings on a part of each head, optional q/k/v biases. Its attention reshapes by its own head
counts (`num_heads`, `num_key_value_heads`), which each tp rank holds 1/T of (`tp_heads`). Its
per-head q/k LayerNorms (`qk_layernorm`) would split by head too: refused under tp before launch
(`plait/config/checks_hf.py`)."""

from __future__ import annotations

from plait.model.families.family import Family, Refusal
from plait.model.families.llama import LLAMA_LIKE
from plait.model.plan import ModelPlan

FAMILY = Family("hf-stablelm", ("StableLmForCausalLM",), ModelPlan(
    family="hf-stablelm", **LLAMA_LIKE,
    tp_heads=("self_attn.num_heads", "self_attn.num_key_value_heads"),
), refused=(Refusal("tp", "qk_layernorm", "a LayerNorm per head for queries and keys"),))
