"""The shape of plait's Llama-style decoder (dense or mixture of experts), and named sizes. Also
what the formulas (FLOPs, state and activation bytes) read of any transformer: a Hugging Face
model's config is described by the same fields (`plait/model/hf.py: hf_args`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    # SwiGLU hidden size: 2/3 * 4 * dim * ffn_multiplier, rounded up to `multiple_of`
    # (the Llama recipe keeps the parameter count of a 4*dim GELU MLP).
    ffn_multiplier: float = 1.0
    multiple_of: int = 32
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    intermediate_size: int = 0  # the SwiGLU hidden size, when given (an imported model's)
    # Mixture of experts (`moe.py`): every `moe_every`-th block's feed-forward is E = moe_experts
    # SwiGLU experts of ffn_dim hidden units each behind a router; 0 experts: dense.
    moe_experts: int = 0
    moe_top_k: int = 2  # experts per token (expert choice: the mean, sizing each expert's pick)
    moe_every: int = 1  # blocks i with (i + 1) % moe_every == 0 are MoE
    moe_capacity_factor: float = 0.0  # capacity = ceil(factor * tokens * top_k / E); 0: dropless
    moe_router: str = "token_choice"  # "token_choice" (top-k per token) | "expert_choice"
    moe_aux_loss_coef: float = 0.01  # Switch / GShard load-balancing loss
    moe_z_loss_coef: float = 0.0  # router z-loss (ST-MoE)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def is_moe(self, layer: int) -> bool:
        return self.moe_experts > 0 and (layer + 1) % self.moe_every == 0

    def problem(self) -> tuple[str, str] | None:
        """What is wrong with these sizes as plait's Llama reads them: (its `model.*` key, why
        and what to give), or None. The config's checks call it for a run of plait's Llama."""
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len",
                     "multiple_of", "moe_every"):
            if getattr(self, name) < 1:
                return name, f"must be >= 1, got {getattr(self, name)}"
        for name, ok, want in (
                ("intermediate_size", self.intermediate_size >= 0, ">= 0 (0: from ffn_multiplier)"),
                ("moe_experts", self.moe_experts >= 0, ">= 0 (0: dense)"),
                ("moe_capacity_factor", self.moe_capacity_factor >= 0, ">= 0 (0: dropless)"),
                ("moe_aux_loss_coef", self.moe_aux_loss_coef >= 0, ">= 0"),
                ("moe_z_loss_coef", self.moe_z_loss_coef >= 0, ">= 0"),
                ("norm_eps", self.norm_eps > 0, "> 0"), ("rope_theta", self.rope_theta > 0, "> 0"),
                ("ffn_multiplier", self.ffn_multiplier > 0, "> 0")):
            if not ok:
                return name, f"must be {want}, got {getattr(self, name)}"
        if self.dim % self.n_heads:
            return "dim", f"dim={self.dim} must be divisible by n_heads={self.n_heads}"
        if self.head_dim % 2:
            return "dim", "dim / n_heads must be even for rotary embeddings"
        if self.n_heads % self.n_kv_heads:
            return "n_kv_heads", f"must divide n_heads={self.n_heads}, got {self.n_kv_heads}"
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            return "moe_top_k", (f"must be in [1, moe_experts={self.moe_experts}], got "
                                 f"{self.moe_top_k}")
        return None

    @property
    def ffn_dim(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        hidden = int(2 * 4 * self.dim / 3 * self.ffn_multiplier)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


# Named sizes. The small ones train on a laptop; the large ones are built on the `meta` device by
# the planner for their shapes (Llama-2 7B / Llama-3 70B dimensions).
PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, multiple_of=16),
    "small": ModelArgs(dim=192, n_layers=4, n_heads=6, n_kv_heads=2, max_seq_len=256),
    "125m": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000,
                      max_seq_len=2048, multiple_of=256),
    "1b": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                    ffn_multiplier=1.5, max_seq_len=4096, multiple_of=256, rope_theta=500000.0),
    # Mixtures of experts: 8 experts, top-2 (tiny: every block; small: every other block, experts
    # of half the dense hidden size).
    "tiny-moe": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                          multiple_of=16, moe_experts=8, moe_top_k=2),
    "small-moe": ModelArgs(dim=192, n_layers=4, n_heads=6, n_kv_heads=2, max_seq_len=256,
                           ffn_multiplier=0.5, moe_experts=8, moe_top_k=2, moe_every=2),
    "7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                    max_seq_len=4096, multiple_of=256),
    # Llama-2 13B's dimensions.
    "13b": ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000,
                     max_seq_len=4096, multiple_of=256),
    "70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                     ffn_multiplier=1.3, max_seq_len=8192, multiple_of=1024, rope_theta=500000.0),
    # Llama 3 405B's (Llama Team 2024, table 3): 126 layers of 16384, 128 heads sharing 8 key/value
    # heads, feed-forward 53248.
    "405b": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                      max_seq_len=8192, intermediate_size=53248, rope_theta=500000.0),
    # GPT-3 175B's (Brown et al. 2020): 96 layers of 12288, 96 heads, 2048 tokens, the vocabulary
    # padded to 51200 as Megatron-LM does; the SwiGLU hidden size 32768 keeps GPT-3's 12 dim^2
    # parameters per block (175.2B in all, embedding and head untied).
    "175b": ModelArgs(dim=12288, n_layers=96, n_heads=96, n_kv_heads=96, vocab_size=51200,
                      max_seq_len=2048, intermediate_size=32768),
    # Mixtral 8x7B's dimensions: 8 experts of 14336 hidden units, top-2, in every block.
    "8x7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                      max_seq_len=4096, intermediate_size=14336, rope_theta=1e6, moe_experts=8,
                      moe_top_k=2),
}


def model_args(preset: str, **overrides) -> ModelArgs:
    """The preset's sizes with the given fields replaced."""
    return replace(PRESETS[preset], **overrides)
