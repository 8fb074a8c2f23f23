"""Hugging Face causal language models, the transformers modules themselves, under plait.

`model.hf = "DIR"` names a local folder as `save_pretrained` writes it: config.json, and weights
in safetensors (or none: a fresh init from `train.seed`). transformers builds the model; plait
keeps its modules and runs them (`HFCausalLM`), under plait's names for them (where the family
keeps each: its `Family`, `plait/model/families/`; the Llama-shaped families' here):

    embed_tokens      the model's input embedding                (HF: model.embed_tokens)
    layers.{i}        its decoder layers, keyed by index         (HF: model.layers.{i})
    norm, lm_head     its final norm and output head             (HF: model.norm, lm_head)
    rotary_emb        its rotary embedding (no parameters)       (HF: model.rotary_emb)

and its forward in the three pieces a pipeline chunk needs, doing what the family's own
`*Model.forward` does for a batch of whole sequences without padding or cache: embed, positions
0..s-1 and their rotary (cos, sin) from the model's own `rotary_emb`, each decoder layer as the
model calls it (no mask: transformers' SDPA attention is then causal), the norm, the head.
`hf_name` gives a parameter's transformers name back.

The family's plan says how the parallelisms cut it. A family with no plan (GPT-2, ...) trains
as a plain module: DDP and ZeRO-1/2/3.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from plait.model.documents import Documents
from plait.model.families import Family, family_for
from plait.model.fused import as_linear, fuse_apart, join_parts
from plait.model.hf_config import (  # noqa: F401  (the folder's reading, torch-free, re-exported)
    HF_PLANS,
    architecture,
    has_weights,
    hf_args,
    read_config,
)
from plait.model.materialize import Rows, SafetensorsFile, Stacked, params_on_meta

ATTENTION = "plait"  # the name of plait's entry in transformers' AttentionInterface


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None,
              dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function for plait's models: the attention module's `core`
    kernel where one was put (context parallelism's: (b, s, heads, d) in and out), else
    transformers' own SDPA function. q (b, heads, s, d), k and v (b, kv_heads, s, d), rotated;
    returns (b, s, heads, d). The mask is plait's `Documents` under `data.document_mask` (the
    layers pass it through untouched): the kernel's, or the SDPA mask it makes."""
    # here, not at the top: transformers only for a Hugging Face model
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    core = getattr(module, "core", None)
    documents = attention_mask if isinstance(attention_mask, Documents) else None
    if core is None:
        mask = attention_mask if documents is None else documents.additive(query.dtype)
        window = kwargs.get("sliding_window")
        if window and window < key.shape[-2]:  # this layer's (Mistral's, Gemma2's every other)
            mask = windowed(mask, window, query.shape[-2], key.shape[-2], query.device)
        if getattr(module.config, "plait_inner_attention", "sdpa") == "eager":
            return _eager(module, query, key, value, mask, dropout, scaling, **kwargs)
        return sdpa_attention_forward(module, query, key, value, mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if (attention_mask is not None and documents is None) or dropout or \
            scaling != query.shape[-1] ** -0.5 or kwargs.get("softcap") is not None:
        raise ValueError("plait's attention kernels compute causal attention (within documents "
                         "under data.document_mask) scaled by 1/sqrt(head_dim), without dropout "
                         "or soft-capped scores")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return (core(q, k, v) if documents is None else core(q, k, v, documents)), None


def windowed(mask: torch.Tensor | None, window: int, queries: int, keys: int,
             device) -> torch.Tensor:
    """`mask` (additive or boolean, (batch or 1, 1, queries, keys); None: causal) with each query
    seeing only the `window` keys up to its own (query i, the last of the keys, sees key j when
    0 <= i - j < window), as transformers' sliding-window mask: boolean where `mask` is None."""
    at = torch.arange(keys, device=device)
    gap = at[keys - queries:, None] - at[None, :]  # each query's position minus each key's
    band = ((gap >= 0) & (gap < window))[None, None]
    if mask is None or mask.dtype == torch.bool:
        return band if mask is None else mask & band
    return mask.masked_fill(~band, float("-inf"))


def _eager(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           mask: torch.Tensor | None, dropout: float, scaling: float | None, **kwargs):
    """The family's own eager attention (its modeling module's `eager_attention_forward`), with
    the causal mask it needs as an additive one (SDPA's is implied where there is none, or a
    boolean one: True where a query sees a key), (batch or 1, 1, queries, keys)."""
    import sys

    eager = sys.modules[type(module).__module__].eager_attention_forward
    if mask is None:
        mask = causal_mask(query.shape[-2], key.shape[-2], query.dtype, query.device)
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device) \
            .masked_fill(~mask, float("-inf"))
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def _as_planned(layer: nn.Module, family: Family, config) -> None:
    """A decoder layer as the family's plan splits it: Conv1Ds and `plain_linears` as
    `nn.Linear`, fused projections apart, a tuple out made the hidden states alone."""
    for path in family.conv1d:
        as_linear(layer, path)
    for path in family.plain_linears:
        layer.get_submodule(path).__class__ = nn.Linear  # the same product, the same parameters
    for path, fields in family.fused.items():
        fuse_apart(layer, path, [getattr(config, f) for f in fields])
    if family.layer_returns_tuple:
        layer.register_forward_hook(_hidden_states)


def _hidden_states(module: nn.Module, args: tuple, out):
    return out[0]  # (hidden states, attention weights) -> the hidden states


def causal_mask(queries: int, keys: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The additive causal mask (1, 1, queries, keys), the queries the last of the keys: 0 where
    a query sees a key, -inf elsewhere."""
    seen = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
    return torch.zeros(1, 1, queries, keys, dtype=dtype, device=device) \
        .masked_fill(~seen, float("-inf"))


def softcapped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """c tanh(z / c), as the family caps its logits (Gemma2's `final_logit_softcapping`)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def arange_positions(seq_len: int, device) -> torch.Tensor:
    """The positions of a whole sequence's tokens (context parallelism replaces this)."""
    return torch.arange(seq_len, device=device)


def _through_plait(config) -> None:
    """Attention through plait's entry (transformers' own SDPA until a kernel is put in)."""
    # here, not at the top: transformers only for a Hugging Face model
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # plait's entry takes SDPA's masks
    # What plait's entry computes without a kernel put in: the attention transformers was
    # given (model.attention).
    config.plait_inner_attention = config._attn_implementation
    config._attn_implementation = ATTENTION


class HFCausalLM(nn.Module):
    """A transformers `*ForCausalLM` of a planned family, its modules under plait's names and
    plan (`Family`: where the family keeps each piece). forward: (b, s) token ids -> (b, s,
    vocab) logits."""

    def __init__(self, hf: nn.Module, family: Family):
        super().__init__()
        self.family, self.plan, self.args = family, family.plan, hf.config
        for mine, theirs in family.modules.items():
            module = hf.get_submodule(theirs)
            if mine == "layers":
                module = nn.ModuleDict({str(i): layer for i, layer in enumerate(module)})
            setattr(self, mine, module)
        for layer in self.layers.values():
            _as_planned(layer, family, hf.config)
        self.positions = arange_positions
        cap = getattr(hf.config, family.logit_softcap, None) if family.logit_softcap else None
        self.lm_head.logit_softcap = cap  # the loss reads it (`HeadCrossEntropy`)
        self.loss_function = hf.loss_function  # the family's own (transformers' LOSS_MAPPING)
        if not family.own_attention:  # else its attention is transformers' own (`block_args`)
            _through_plait(hf.config)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        learned = getattr(self, "position_embeddings", None)  # GPT-2's, where the family has them
        if learned is not None:
            at = learned(self.positions(tokens.shape[1], tokens.device))
            shard = getattr(self.embed_tokens, "sequence_shard", None)  # sequence parallelism's
            h = h + (at if shard is None else at.chunk(shard[1], dim=-2)[shard[0]])
        dropout = getattr(self, "embed_dropout", None)  # the family's, where its model has one
        return h if dropout is None else dropout(h)

    def block_args(self, h: torch.Tensor, seq_len: int,
                   documents: Documents | None = None) -> dict:
        """What each decoder layer takes besides the hidden states, by keyword (the families
        order them differently): no mask (causal SDPA), the positions of the tokens (0..s-1;
        the shard's under context parallelism) and their rotary embeddings (cos, sin), as the
        model computes them. With `documents`: positions that restart at each document (per
        row, as transformers' packed sequences give them) and the documents as the mask, which
        plait's attention function (`attention`) reads."""
        if documents is None:
            positions = self.positions(seq_len, h.device).unsqueeze(0)
        else:
            documents = documents.to(h.device)
            positions = documents.positions()
        extra = {**self.family.layer_kwargs, "attention_mask": documents,
                 "position_ids": positions}
        if self.family.own_attention:  # the mask its own attention needs
            extra["attention_mask"] = _own_mask(self.args, seq_len, h, documents)
        rotary = getattr(self, "rotary_emb", None)  # none where positions are learned (GPT-2)
        return extra if rotary is None else {**extra, "position_embeddings": rotary(h, positions)}

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)  # what the output head reads (a pipeline chunk calls it unbound)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return softcapped(self.lm_head(self.norm(h)), self.lm_head.logit_softcap)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, documents: Documents | None = None):
        """(b, s) token ids -> (b, s, vocab) logits; as transformers' model is called, with a
        padding `attention_mask` (b, s) (transformers' `create_causal_mask` makes it the
        layers' mask; all ones is no mask) and `labels` (b, s): then `CausalLMOutput` with the
        family's own loss (transformers' `loss_function`: shifted, -100 ignored). Or with
        `documents` instead of a mask: the windows' documents (`data.document_mask`)."""
        # Written against the pieces a one-chunk pipeline holds too (it runs this forward on
        # itself for a batch with a mask or labels): the class's functions, the plan's modules.
        if attention_mask is not None and documents is not None:
            raise ValueError("a padding attention_mask or documents, not both")
        h = HFCausalLM.embed(self, input_ids)
        extra = HFCausalLM.block_args(self, h, input_ids.shape[1], documents)
        if attention_mask is not None:
            # here, not at the top: transformers only for a Hugging Face model
            from transformers.masking_utils import create_causal_mask

            # Shaped by the whole sequence (h holds a shard of it under sequence parallelism).
            whole = h.new_empty(*input_ids.shape, 1)
            extra["attention_mask"] = create_causal_mask(
                config=self.args, inputs_embeds=whole, attention_mask=attention_mask, cache=None,
                position_ids=extra["position_ids"])
        for layer in self.layers.values():
            h = layer(h, **extra)
        logits = HFCausalLM.head(self, h)
        return logits if labels is None else _with_loss(self, logits, labels)


def _own_mask(config, seq_len: int, h: torch.Tensor,
              documents: Documents | None) -> torch.Tensor | None:
    """The mask for a family's own attention (`Family.own_attention`): the documents' (additive),
    else none where it calls SDPA (then causal), else the causal one made explicit."""
    if documents is not None:
        return documents.additive(h.dtype)
    if config._attn_implementation == "sdpa":
        return None
    return causal_mask(seq_len, seq_len, h.dtype, h.device)


def _with_loss(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor):
    # here, not at the top: transformers only for a Hugging Face model
    from transformers.modeling_outputs import CausalLMOutput

    loss = model.loss_function(logits=logits, labels=labels,
                               vocab_size=model.args.vocab_size)
    return CausalLMOutput(loss=loss, logits=logits)


class PlainCausalLM(nn.Module):
    """A transformers causal LM of a family with no plan: the module whole, (b, s) token ids ->
    (b, s, vocab) logits. Parameter names are transformers' own, under `hf.`."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf, self.args = hf, hf.config

    @property
    def unit_classes(self) -> tuple[type[nn.Module], ...]:
        """ZeRO-3's units by default (`parallel.wrap` empty): the classes transformers names in
        `_no_split_modules` (a family's decoder layer, as accelerate's FSDP auto-wrap reads it),
        of those present."""
        names = set(getattr(self.hf, "_no_split_modules", None) or ())
        return tuple(dict.fromkeys(type(m) for m in self.hf.modules()
                                   if type(m).__name__ in names))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None):
        """(b, s) token ids -> logits; with `labels`, transformers' output (its own loss)."""
        out = self.hf(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                      use_cache=False)
        return out.logits if labels is None else out


def hf_tensors(tensors: dict[str, torch.Tensor], family: Family | None) -> dict:
    """A model's whole tensors by plait's names as transformers' state dict holds them: fused
    projections' parts joined, Conv1D weights transposed back, transformers' names."""
    if family is None:
        return {hf_name(n, None): t for n, t in tensors.items()}
    tensors = join_parts(tensors)
    conv1d = {f"{family.plan.blocks}.{i}.{path}.weight" for path in family.conv1d
              for i in _layer_indices(tensors, family.plan.blocks)}
    return {hf_name(n, family): t.t() if n in conv1d else t for n, t in tensors.items()}


def _layer_indices(names, blocks: str) -> set[str]:
    return {n.split(".")[1] for n in names if n.startswith(f"{blocks}.")}


def hf_name(name: str, family: Family | None) -> str:
    """transformers' state-dict name of a parameter of `HFCausalLM` (of `family`) or of
    `PlainCausalLM` (None)."""
    return name.removeprefix("hf.") if family is None else family.hf_name(name)


def load_hf(folder: str | Path, seed: int = 0, device: torch.device | str = "cpu",
            weights: bool = True, attention: str = "auto") -> nn.Module:
    """The model in `folder` as transformers builds it (float32, the `attention` model.attention
    chooses: `attention_of`), weights from its safetensors or, with none, initialised by
    transformers from `seed` (on `meta`: shapes alone; `weights=False`: the modules only, as
    `load_hf_sharded` builds them); wrapped for plait: `HFCausalLM` when its family has a plan,
    else `PlainCausalLM`."""
    hf = transformers_model(folder, seed, device, weights, attention)
    family = family_for(hf.config.to_dict())
    return HFCausalLM(hf, family) if family is not None else PlainCausalLM(hf)


def load_hf_sharded(folder: str | Path, device: torch.device | str = "cpu",
                    attention: str = "auto"):
    """(the model of `folder` with its parameters on `meta` and its buffers on `device`, the
    `SafetensorsFile` its ranks materialize their parts from), or None where that cannot be
    done: a folder with no weights (transformers initialises a fresh model whole), or one whose
    file holds a tensor under a name or shape that neither the module's nor `OLDER_NAMES`
    gives."""

    if not has_weights(folder):
        return None
    with params_on_meta():
        model = load_hf(folder, 0, device, weights=False, attention=attention)
    family = model.family if isinstance(model, HFCausalLM) else None
    source = SafetensorsFile(folder, None, device)
    keys = {name: filed_as(name, family, model.args, source) for name, _ in
            model.named_parameters()}
    source.rename = keys.__getitem__
    for name, p in model.named_parameters():
        if source.shape(keys[name], p.shape[0] if p.dim() else 0) != tuple(p.shape):
            return None
    return model, source


def filed_as(name: str, family: Family | None, config, source: SafetensorsFile):
    """Where a folder's file holds plait's parameter `name`: under transformers' name for it
    (`file_key`), or, for a fused projection's part or a Conv1D's weight (held otherwise than
    filed: `Family.fused`, `Family.conv1d`), as its rows of the file's tensor (`Rows`)."""
    part = re.search(r"\.parts\.(\d+)\.", name)  # `FusedLinear`'s
    whole = name if part is None else f"{name[:part.start()]}.{name[part.end():]}"
    key = file_key(hf_name(whole, family), source.where)
    if family is None or isinstance(key, Stacked):
        return key
    path = whole.split(".", 2)[-1].rpartition(".")[0]  # block-relative (a block's linear)
    transposed = whole.endswith(".weight") and path in family.conv1d
    if part is None:
        return Rows(key, transposed=True) if transposed else key
    shape = source.shape(key)
    if shape is None:
        return key
    counts = [getattr(config, f) for f in family.fused[path]]
    rows = shape[-1 if transposed else 0] // sum(counts)  # per count
    i = int(part.group(1))
    return Rows(key, rows * sum(counts[:i]), rows * counts[i], transposed)


# Names a file may hold instead of the modules' (transformers renames and stacks them on load):
# Mixtral's router and its experts, stored one expert at a time. (module name, file's name).
OLDER_NAMES = [
    (re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.weight$"),
     "model.layers.{i}.block_sparse_moe.gate.weight"),
    (re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj$"),
     Stacked(("model.layers.{i}.block_sparse_moe.experts.{{e}}.w1.weight",
              "model.layers.{i}.block_sparse_moe.experts.{{e}}.w3.weight"))),
    (re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.down_proj$"),
     Stacked(("model.layers.{i}.block_sparse_moe.experts.{{e}}.w2.weight",))),
]


def file_key(key: str, present) -> str | Stacked:
    """Where a folder's file holds transformers' parameter `key`: under that name, or under an
    older one (`OLDER_NAMES`)."""
    if key in present:
        return key
    for pattern, older in OLDER_NAMES:
        m = pattern.match(key)
        if m:
            if isinstance(older, Stacked):
                return Stacked(tuple(part.format(i=m.group(1)) for part in older.parts))
            return older.format(i=m.group(1))
    return key


def attention_of(config, choice: str = "auto") -> str:
    """The attention transformers computes the family with (`model.attention`): "auto", SDPA
    where its class supports it (every planned family), else the family's eager attention
    (Gemma2's soft-capped scores, BLOOM's ALiBi: transformers refuses SDPA for them); or the
    `choice` given. For a planned family plait's own entry calls it (`HFCausalLM`, `attention`)."""
    return choice if choice != "auto" else "sdpa" if supports_sdpa(config) else "eager"


def supports_sdpa(config) -> bool:
    """Whether transformers computes the family of `config` with SDPA."""
    # here, not at the top: transformers only for a Hugging Face model
    from transformers import AutoModelForCausalLM

    family = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return getattr(family, "_supports_sdpa", True)


def transformers_model(folder: str | Path, seed: int = 0, device: torch.device | str = "cpu",
                       weights: bool = True, attention: str = "auto") -> nn.Module:
    """The `*ForCausalLM` of `folder` as transformers builds it, unwrapped (`load_hf`)."""
    # here, not at the top: transformers only for a Hugging Face model
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # one bar per worker per load is noise
    config = AutoConfig.from_pretrained(folder)
    kwargs = dict(dtype=torch.float32, attn_implementation=attention_of(config, attention))
    if torch.device(device).type == "meta":  # shapes alone (--dry-run): nothing read or drawn
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(config, **kwargs)
    elif not weights:  # modules alone (under `params_on_meta`: parameters on `meta`)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, **kwargs).train()
    elif has_weights(folder):
        hf = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    else:
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(config, **kwargs)
    return hf.to(device).train()
