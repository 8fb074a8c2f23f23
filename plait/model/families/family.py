"""A Hugging Face family under plait, as data (`Family`); the families: `plait.model.families`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from plait.model.plan import ModelPlan

# Where a transformers decoder keeps its pieces, by plait's name for each (`HFCausalLM`): the
# Llama-shaped `*ForCausalLM` (model.embed_tokens, model.layers, model.norm, model.rotary_emb,
# lm_head), which most families are.
DECODER = {"embed_tokens": "model.embed_tokens", "layers": "model.layers", "norm": "model.norm",
           "rotary_emb": "model.rotary_emb", "lm_head": "lm_head"}


@dataclass(frozen=True)
class Family:
    """A transformers family under plait: `architectures` (config.json's names of its
    `*ForCausalLM`), its `plan`, and `modules`: plait's name of each piece `HFCausalLM` keeps ->
    transformers' path to it (`embed_tokens`, `layers` (the decoder layers' list), `norm`,
    `rotary_emb` (none for a family of learned positions), `lm_head`; optionally
    `position_embeddings`, learned positions added to the embeddings, and `embed_dropout`,
    applied to the embeddings as the family's model does)."""

    name: str
    architectures: tuple[str, ...]
    plan: ModelPlan
    modules: Mapping[str, str] = field(default_factory=lambda: dict(DECODER))
    # Linears that compute several projections side by side (Phi3's qkv_proj), held as one
    # linear per part (`plait/model/fused.py`): block-relative path -> the config fields whose
    # counts size the parts, in order.
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Block-relative linears transformers keeps as `Conv1D` (GPT-2's: the weight stored
    # (in, out)), held as `nn.Linear`s (the weight transposed) so that tp splits them as any
    # linear; the export transposes them back.
    conv1d: tuple[str, ...] = ()
    # Its MLP, for the formulas (`Shape.mlp`): "gated" (gate and up, then down) or "plain".
    mlp: str = "gated"
    # The config key of a soft cap on the logits (c tanh(z / c): Gemma2's), which the head
    # applies (`HFCausalLM`: its `logit_softcap`).
    logit_softcap: str | None = None
    # config.json keys that, set, give the attention what context parallelism's kernels do not
    # compute: key -> what (refused under cp before launch).
    cp_refused: Mapping[str, str] = field(default_factory=dict)
    # config.json keys that, true, give the layers modules the plan does not split by tp:
    # key -> what they are (refused under tp before launch, `plait/config/checks_hf.py`).
    tp_refused: Mapping[str, str] = field(default_factory=dict)

    def hf_name(self, name: str) -> str:
        """transformers' state-dict name of plait's parameter `name` (`layers.0.x` ->
        `model.layers.0.x`)."""
        piece, dot, rest = name.partition(".")
        return f"{self.modules[piece]}{dot}{rest}"
