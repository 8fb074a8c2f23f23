"""Which configuration keys pin a plan's degrees (`plait plan parallel.tp=2 ...`): read without
torch, so that the command can refuse impossible pins before it imports the search."""

from __future__ import annotations

import math

from plait.config.schema import Config, ConfigError
from plait.mesh import AXES

PINNABLE = {"parallel.tp": "tp", "parallel.pp": "pp", "parallel.cp": "cp", "parallel.ep": "ep",
            "parallel.cp_method": "cp_method", "parallel.zero": "zero",
            "parallel.dp_shard": "dp_shard", "parallel.microbatches": "microbatches",
            "parallel.pp_schedule": "pp_schedule",
            "parallel.sequence_parallel": "sequence_parallel", "parallel.offload": "offload",
            "train.activation_checkpointing": "activation_checkpointing",
            "parallel.dp": "dp", "parallel.pp_virtual": "pp_virtual"}


def pinned(cfg: Config, overrides: list[str]) -> dict:
    """The degrees the user's overrides fix (the others are searched)."""
    out = {}
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in PINNABLE:
            section, name = key.split(".")
            out[PINNABLE[key]] = getattr(getattr(cfg, section), name)
    if out.get("dp") == 0:  # dp = 0: the rest of the world, as unpinned
        del out["dp"]
    return out


def check_mesh_pins(fixed: dict, gpus: int) -> None:
    """The mesh degrees pinned (`pinned`) multiply to a divisor of the GPUs, or no layout can be
    valid: said before the search (which prices layouts to find none)."""
    pins = {a: fixed[a] for a in AXES if a in fixed and fixed[a] > 0}
    product = math.prod(pins.values())
    if gpus % product:
        said = " * ".join(f"{a}={v}" for a, v in pins.items())
        raise ConfigError("plan", f"the pinned degrees {said} = {product} do not divide "
                          f"--gpus={gpus}; change --gpus or the pinned degrees")
