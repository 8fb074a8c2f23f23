"""What the formulas read of a decoder-only transformer, whichever family it is (`Shape`): the
sizes of its layers, heads, MLP and vocabulary, and the kinds of its norms, MLP and attention.
plait's Llama describes itself from its `ModelArgs` (`Shape.of_llama`), a Hugging Face family
from its config.json (`plait/model/hf_config.py: hf_shape`). The cost, activation and planner
formulas (`plait/predict/`, `plait/planner/`) read a `Shape`, never a family's own fields.
torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from plait.model.args import ModelArgs


@dataclass(frozen=True)
class Shape:
    hidden: int  # the residual stream's width
    layers: int
    heads: int  # query heads
    kv_heads: int  # key/value heads (grouped-query attention: fewer)
    head_dim: int  # each head's width (not always hidden / heads: Gemma, Qwen3)
    ffn: int  # the MLP's hidden units (each expert's, under a mixture of experts)
    vocab: int
    max_positions: int
    experts: int = 0  # a mixture of experts' experts per MoE block; 0: dense
    top_k: int = 2  # experts per token
    moe_every: int = 1  # blocks i with (i + 1) % moe_every == 0 are MoE
    norm: str = "rms"  # "rms" (RMSNorm) | "layer" (LayerNorm)
    mlp: str = "gated"  # "gated" (SwiGLU: gate and up, then down) | "plain" (up, act, down)
    tied: bool = False  # input embedding and output head one matrix
    attention: str = "causal"  # "causal" (full) | "alibi" (distance biases, no positions)
    # The numbers the forward uses the weights with.
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and (layer + 1) % self.moe_every == 0

    @staticmethod
    def of_llama(args: ModelArgs) -> Shape:
        """plait's Llama (`plait/model/llama.py`): RMSNorm, SwiGLU, untied, rotary positions."""
        return Shape(hidden=args.dim, layers=args.n_layers, heads=args.n_heads,
                     kv_heads=args.n_kv_heads, head_dim=args.head_dim, ffn=args.ffn_dim,
                     vocab=args.vocab_size, max_positions=args.max_seq_len,
                     experts=args.moe_experts, top_k=args.moe_top_k, moe_every=args.moe_every,
                     norm_eps=args.norm_eps, rope_theta=args.rope_theta)
