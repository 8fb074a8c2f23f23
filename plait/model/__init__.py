"""Single-device models. No distributed code lives here.

plait's Llama (`llama.py`) is imported when first asked for, so that reading a configuration's
model shape (`args.py`) imports no torch."""

from __future__ import annotations

import importlib

from plait.model.args import PRESETS, ModelArgs

_LLAMA = ("Llama", "build_model", "count_params", "init_weights", "model_args")


def __getattr__(name: str):
    if name in _LLAMA:
        return getattr(importlib.import_module("plait.model.llama"), name)
    raise AttributeError(f"module 'plait.model' has no attribute {name!r}")


def build_configured(args: ModelArgs, seed: int, device="cpu", hf: str = "",
                     attention: str = "auto"):
    """The model a configuration names, whole: plait's Llama of `args`, or the Hugging Face
    folder `hf` (`plait/model/hf.py`; on `meta`: shapes alone; with `attention`, model.attention),
    initialised from `seed`."""
    if hf:
        # here, not at the top: plait.model's package and shapes are read by the torch-free checks
        from plait.model.hf import load_hf

        return load_hf(hf, seed, device, attention=attention)
    # here, not at the top: plait.model's package and shapes are read by the torch-free checks
    from plait.model.llama import build_model

    return build_model(args, seed, device)


def build_sharded(args: ModelArgs, seed: int, device="cpu", hf: str = "",
                  attention: str = "auto"):
    """(the model `build_configured` builds, with its parameters on `meta`, the `Source` each
    rank materializes its parts from: `parallelize` does, after cutting it), for a model no rank
    holds whole (`plait.model.materialize`). A Hugging Face folder whose weights cannot be read
    by slices (`load_hf_sharded`) is built whole, with no source."""
    # here, not at the top: plait.model's package and shapes are read by the torch-free checks
    from plait.model.llama import build_model
    from plait.model.materialize import NamedInit

    if hf:
        # here, not at the top: plait.model's package and shapes are read by the torch-free checks
        from plait.model.hf import load_hf_sharded

        return load_hf_sharded(hf, device, attention) or \
            (build_configured(args, seed, device, hf, attention), None)
    return build_model(args, seed, "meta"), NamedInit(seed, args.n_layers, device)


__all__ = [
    "PRESETS",
    "ModelArgs",
    "Llama",
    "build_configured",
    "build_model",
    "build_sharded",
    "count_params",
    "init_weights",
    "model_args",
]
