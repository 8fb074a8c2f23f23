"""transformers' GPT-2: learned positions added to the embeddings (`transformer.wpe`), LayerNorms
before each half, a plain MLP, biases everywhere, and linears kept as `Conv1D` (weights stored
(in, out)), held as `nn.Linear`s (`Family.conv1d`); q, k and v in one projection (`c_attn`),
held as one linear per part (`Family.fused`). Its attention cuts q from k and v by its own
width (`attn.split_size`) and reshapes by its head count, which each tp rank divides."""

from __future__ import annotations

from plait.model.families.family import Family
from plait.model.plan import ModelPlan

FAMILY = Family(
    "hf-gpt2", ("GPT2LMHeadModel",),
    ModelPlan(
        family="hf-gpt2",
        blocks="layers",
        first=("embed_tokens", "position_embeddings", "embed_dropout"),
        last=("norm", "lm_head"),
        shared=("positions", "loss_function", "family"),
        hidden_size="n_embd",
        tp_splits={"attn.c_attn.parts.*": 0, "attn.c_proj": 1, "mlp.c_fc": 0, "mlp.c_proj": 1},
        tp_halves=("attn", "mlp"),
        tp_divides=("n_head", "n_embd", "vocab_size"),
        tp_heads=("attn.split_size", "attn.num_heads"),
        vocab_embedding="embed_tokens",
        vocab_head="lm_head",
        attention_core="attn.core",
        positions="positions",
        recompute=("ln_1", "ln_2", "mlp.act"),
    ),
    modules={"embed_tokens": "transformer.wte", "position_embeddings": "transformer.wpe",
             "embed_dropout": "transformer.drop", "layers": "transformer.h",
             "norm": "transformer.ln_f", "lm_head": "lm_head"},
    conv1d=("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
    fused={"attn.c_attn": ("n_embd", "n_embd", "n_embd")},
    mlp="plain",
)
