"""The Hugging Face families plait splits, one module each: what plait must know of a family, as
data (`Family`: its plan, where transformers keeps its pieces), and one line each in `FAMILIES`.
torch-free: the checks before launch read it. Adding a family is a module here and a line below
(docs/hf.md, "A family of your own")."""

from __future__ import annotations

from plait.model.families import (
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
from plait.model.families.family import DECODER, Family

FAMILIES: dict[str, Family] = {
    arch: f for f in (*llama.FAMILIES, mixtral.FAMILY, stablelm.FAMILY, starcoder2.FAMILY,
                      gpt_neox.FAMILY, olmo2.FAMILY, gemma2.FAMILY, phi3.FAMILY, gpt2.FAMILY)
    for arch in f.architectures
}


def family_of(architecture: str) -> Family | None:
    """The family whose `*ForCausalLM` is `architecture` (config.json's), or None: no plan."""
    return FAMILIES.get(architecture)


__all__ = ["DECODER", "FAMILIES", "Family", "family_of"]
