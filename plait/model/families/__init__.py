"""The Hugging Face families plait splits, one module each: what plait must know of a family, as
data (`Family`: its plan, where transformers keeps its pieces), and one line each in `FAMILIES`.
torch-free: the checks before launch read it. Adding a family is a module here and a line below
(docs/hf.md, "A family of your own")."""

from __future__ import annotations

from plait.model.families import (
    falcon,
    gemma2,
    gpt2,
    gpt_neox,
    llama,
    mixtral,
    olmo2,
    phi3,
    stablelm,
    starcoder2,
)
from plait.model.families.family import DECODER, Family, Refusal

FAMILIES: dict[str, Family] = {
    arch: f for f in (*llama.FAMILIES, mixtral.FAMILY, stablelm.FAMILY, starcoder2.FAMILY,
                      gpt_neox.FAMILY, olmo2.FAMILY, gemma2.FAMILY, phi3.FAMILY, gpt2.FAMILY,
                      falcon.FAMILY)
    for arch in f.architectures
}


def family_of(architecture: str) -> Family | None:
    """The family whose `*ForCausalLM` is `architecture` (config.json's), or None: no plan."""
    return FAMILIES.get(architecture)


def family_for(config: dict) -> Family | None:
    """The family of a model folder's config.json (a JSON object), or None: none with a plan,
    or a config of its family the plan does not describe (`Family.unplanned_when`)."""
    names = config.get("architectures") or [""]
    family = family_of(names[0])
    if family is not None and any(config.get(key) for key in family.unplanned_when):
        return None
    return family


__all__ = ["DECODER", "FAMILIES", "Family", "Refusal", "family_for", "family_of"]
