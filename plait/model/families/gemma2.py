"""transformers' Gemma2: Gemma's decoder (embeddings scaled by sqrt(hidden), kept by the
vocabulary-parallel embedding) with a norm before and after each half, attention scores
soft-capped (c tanh(s / c), in the family's own eager attention: transformers has no SDPA for
it), on every other layer within a sliding window (plait's attention entry narrows the mask to
it: `plait/model/hf.py: windowed`), and the logits
soft-capped too (`final_logit_softcapping`: the head's `logit_softcap`, which plait's loss and
`HFCausalLM.head` apply). Context parallelism's kernels compute no soft-capped scores: refused."""

from __future__ import annotations

from plait.model.families.family import Family, Refusal
from plait.model.families.llama import LLAMA_LIKE
from plait.model.plan import ModelPlan

FAMILY = Family(
    "hf-gemma2", ("Gemma2ForCausalLM",),
    ModelPlan(family="hf-gemma2", **{
        **LLAMA_LIKE,
        "recompute": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm", "mlp.act_fn")}),
    logit_softcap="final_logit_softcapping",
    refused=(Refusal("cp", "attn_logit_softcapping", "soft-capped attention scores"),),
)
