"""plait's Llama plan names what exists: every pattern matches modules of the dense or the
mixture-of-experts model, and the ZeRO-3 units found from parameter names alone (the planner's
and the formulas' view) are those found from the modules (the engine's view)."""

from __future__ import annotations

import pytest

from plait.model import build_model, model_args
from plait.model.llama_plan import LLAMA
from plait.model.plan import matching
from plait.parallel.engines.units import unit_modules, unit_prefixes
from plait.parallel.pipeline.stage import split_model

MODELS = {"dense": model_args("tiny"), "moe": model_args("tiny-moe")}


def _paths(kind: str, of: str) -> set[str]:
    model = build_model(MODELS[kind], 0, device="meta")
    items = model.layers.values()
    return {p for block in items for p, _ in getattr(block, f"named_{of}")()}


@pytest.mark.parametrize("field,of", [("tp_splits", "modules"), ("recompute", "modules"),
                                      ("tp_partial_grads", "parameters"),
                                      ("tp_halves", "modules")])
def test_every_pattern_of_the_llama_plan_matches(field, of):
    patterns = list(getattr(LLAMA, field))
    found = set()
    for kind in MODELS:
        found |= set(matching(_paths(kind, of), patterns).values())
    assert found == set(patterns)


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("chunks", [1, 2])
def test_units_from_names_are_the_units_of_the_modules(kind, chunks):
    model = build_model(MODELS[kind], 0, device="meta")
    names = {p: n for n, p in model.named_parameters()}
    for chunk in split_model(model, chunks):
        from_modules = [tuple(sorted({names[p] for m in unit for p in m.parameters()}))
                        for unit in unit_modules(chunk)]
        ordered = [n for n, _ in chunk.named_parameters()]
        from_names = [tuple(sorted(n for n in ordered if n.startswith(prefixes)))
                      for prefixes in unit_prefixes(ordered)]
        assert from_names == from_modules
