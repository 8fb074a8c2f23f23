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
class Refusal:
    """A config of the family a parallel axis cannot run: `axis` ("tp" or "cp") > 1 is refused
    where config.json sets `key` (truthy) and not `unless`; `what` it then is."""

    axis: str
    key: str
    what: str
    unless: str | None = None

    def applies(self, config: object) -> bool:
        """Whether `config` (attributes: transformers' config, or config.json's fields) is one
        this refuses."""
        return bool(getattr(config, self.key, None)) and \
            not (self.unless and getattr(config, self.unless, None))


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
    # What the layout cannot do for some configs of the family: refused before launch
    # (`plait/config/checks_hf.py`).
    refused: tuple[Refusal, ...] = ()
    # config.json keys that, true, make the family's model one the plan does not describe
    # (Falcon's ALiBi): it then trains as a family with no plan (dp and ZeRO-1/2/3).
    unplanned_when: tuple[str, ...] = ()
    # Block-relative subclasses of `nn.Linear` that compute what `nn.Linear` computes (Falcon's
    # `FalconLinear`), held as `nn.Linear` so that sequence parallelism keeps their input shard.
    plain_linears: tuple[str, ...] = ()
    # Its attention calls SDPA (or its eager product) itself rather than through transformers'
    # attention interface (Falcon's): plait cannot put a kernel there (the plan names no
    # `attention_core`: cp is refused) and gives the layers the mask that attention needs
    # (none for SDPA's causal one, else an explicit one; the documents' under
    # data.document_mask).
    own_attention: bool = False
    # Keywords every decoder layer is called with besides plait's (Falcon's `alibi`, a
    # positional parameter of its layers: None, rotary positions).
    layer_kwargs: Mapping[str, object] = field(default_factory=dict)
    # Its decoder layers return (hidden states, attention weights) (Falcon's): plait keeps the
    # first.
    layer_returns_tuple: bool = False

    def hf_name(self, name: str) -> str:
        """transformers' state-dict name of plait's parameter `name` (`layers.0.x` ->
        `model.layers.0.x`)."""
        piece, dot, rest = name.partition(".")
        return f"{self.modules[piece]}{dot}{rest}"
