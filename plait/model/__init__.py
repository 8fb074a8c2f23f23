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


def build_configured(args: ModelArgs, seed: int, device="cpu", hf: str = ""):
    """The model a configuration names, whole: plait's Llama of `args`, or the Hugging Face
    folder `hf` (`plait/model/hf.py`; on `meta`: shapes alone), initialised from `seed`."""
    if hf:
        from plait.model.hf import load_hf

        return load_hf(hf, seed, device)
    return build_model(args, seed, device)


__all__ = [
    "PRESETS",
    "ModelArgs",
    "Transformer",
    "build_configured",
    "build_model",
    "count_params",
    "init_weights",
    "model_args",
]
