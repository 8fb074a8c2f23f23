"""Single-device models. No distributed code lives here."""

from plait.model.llama import (
    PRESETS,
    ModelArgs,
    Transformer,
    build_model,
    count_params,
    init_weights,
    model_args,
)

__all__ = [
    "PRESETS",
    "ModelArgs",
    "Transformer",
    "build_model",
    "count_params",
    "init_weights",
    "model_args",
]
