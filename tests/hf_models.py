"""Tiny random Hugging Face models written as `save_pretrained` writes them, and the
single-process reference for them: the transformers module itself trained on the same batches
as plait's trainer would feed it, with plait's optimizer settings, and nothing of plait's
parallel code."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from plait.config.schema import load_config
from plait.data.batches import TokenData
from plait.model.documents import Documents
from plait.model.fused import part_of
from plait.model.hf import hf_name, read_config
from plait.optim.build import build_optimizer, lr_at, set_lr

SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             tie_word_embeddings=False)


def families():
    """name -> (config class, model class, config keys): one per family the tests train."""
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, SHAPE),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, SHAPE),  # q/k/v biases
        "llama-tied": (tf.LlamaConfig, tf.LlamaForCausalLM,  # one matrix: embedding and head
                       {**SHAPE, "tie_word_embeddings": True}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {**SHAPE, "head_dim": 8}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {**SHAPE, "sliding_window": None}),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM,
                    {**SHAPE, "num_hidden_layers": 2, "num_local_experts": 4,
                     "num_experts_per_tok": 2, "sliding_window": None,
                     "router_jitter_noise": 0.0}),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {**SHAPE, "head_dim": 8}),
        # A quarter of each head rotated. Without q/k/v biases: the key bias's unrotated part
        # has a gradient of zero (a constant added to every key's score), which leaves AdamW's
        # step to the summation noise (Qwen2 and Starcoder2 test those biases).
        "stablelm": (tf.StableLmConfig, tf.StableLmForCausalLM,
                     {**SHAPE, "hidden_dropout": 0.0}),
        "starcoder2": (tf.Starcoder2Config, tf.Starcoder2ForCausalLM,  # biases everywhere
                       {**SHAPE, "sliding_window": None, "residual_dropout": 0.0,
                        "embedding_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0}),
        "gpt-neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM,  # attention and MLP side by side
                     {k: v for k, v in SHAPE.items() if k != "num_key_value_heads"}
                     | dict(hidden_dropout=0.0, bos_token_id=0, eos_token_id=0)),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM,  # q and k normed over all heads
                  {**SHAPE, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM,  # q, k, v in one projection, gate and up
                 {**SHAPE, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}),
        "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel,  # head untied: pipeline stages hold it
                 dict(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no random dropout
                      tie_word_embeddings=False)),
        # Falcon's new architecture (Falcon-40B's): each key/value head's queries, key and value
        # side by side in one projection, attention and MLP side by side, each behind a
        # LayerNorm; and its first (Falcon-RW's layout with rotary positions): one LayerNorm,
        # q, k, v per head, biases.
        "falcon": (tf.FalconConfig, tf.FalconForCausalLM,
                   dict(vocab_size=256, hidden_size=32, ffn_hidden_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                        max_position_embeddings=128, tie_word_embeddings=False,
                        bos_token_id=0, eos_token_id=0)),
        "falcon-classic": (tf.FalconConfig, tf.FalconForCausalLM,
                           dict(vocab_size=256, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, multi_query=False, bias=True,
                                max_position_embeddings=128, tie_word_embeddings=False,
                                bos_token_id=0, eos_token_id=0)),
        # Two families transformers computes with their own eager attention (no SDPA): Gemma2's
        # scores soft-capped, sliding windows on alternate layers (half the tests' sequences);
        # BLOOM's ALiBi biases, no position limit in its config.
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM,
                   {**SHAPE, "num_hidden_layers": 2, "head_dim": 8, "sliding_window": 16,
                    "query_pre_attn_scalar": 8}),
        "bloom": (tf.BloomConfig, tf.BloomForCausalLM,
                  dict(vocab_size=256, hidden_size=32, n_layer=2, n_head=4,
                       hidden_dropout=0.0, attention_dropout=0.0)),
    }


def write_model(folder: Path, family: str, seed: int = 0, **changes) -> Path:
    """A tiny random model of `family` saved in `folder` (config.json + model.safetensors)."""
    config_cls, model_cls, keys = families()[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**keys, **changes}))
    model.save_pretrained(folder)
    return folder


def hf_config(folder: Path, *overrides: str, steps: int = 4):
    return load_config(None, [
        f"model.hf='{folder}'", f"train.steps={steps}", "train.warmup_steps=2",
        "train.global_batch=8", "train.peak_tflops=1.0", "train.eval_batches=1",
        "data.seq_len=32", "data.max_bytes=200000", *overrides,
    ])


def train_reference(folder: Path, cfg, steps: int = 4) -> dict:
    """The transformers model of `folder` trained `steps` steps in this process on the global
    batches plait's trainer draws: losses, and parameters by transformers' names."""
    from transformers import AutoModelForCausalLM

    # transformers' own choice of attention: SDPA where the family has it, else eager.
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    params = list(model.parameters())
    optimizer = build_optimizer([p for p in params if p.dim() >= 2],
                                [p for p in params if p.dim() < 2], cfg.train)
    data = TokenData(cfg.data, cfg.train.seed)
    losses = []
    for step in range(steps):
        set_lr(optimizer, lr_at(step, cfg.train))
        optimizer.zero_grad(set_to_none=True)
        inputs, targets, *documents = data.batch(step, cfg.train.global_batch)
        # Documents (data.document_mask): positions restarting at each one, from which
        # transformers makes its own block-diagonal mask ("packed sequences").
        positions = Documents.whole(documents[0]).positions() if documents else None
        with contextlib.nullcontext() if cfg.train.precision == "fp32" else \
                torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 as plait's DDP runs it
            logits = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone()
                                         for n, p in model.named_parameters()}}


def reference_of(name: str, family, params: dict, folder) -> tuple[torch.Tensor, str]:
    """(the reference's tensor for plait's parameter `name`, its transformers name): a fused
    projection's part (`plait/model/fused.py`) is its rows of the fused tensor; a linear
    transformers keeps as a Conv1D (GPT-2's) its transposed weight."""
    if family is None:
        return params[hf_name(name, None)], hf_name(name, None)
    whole = re.sub(r"\.parts\.\d+\.", ".", name)
    hf = hf_name(whole, family)
    tensor = params[hf]
    path = whole.split(".", 2)[-1].rsplit(".", 1)[0]  # block-relative, for a block's
    if whole.endswith(".weight") and path in family.conv1d:
        tensor = tensor.t()
    if whole != name:
        counts = [read_config(folder)[f] for f in family.fused[path]]
        tensor = part_of(name, {whole: tensor}, counts)
    return tensor, hf
