"""What the command-line modules share (`commands.py`, `bench.py`, `data.py`): recipes, the
configuration of a command, output paths checked before anything starts."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from plait.config.paths import creatable
from plait.config.schema import Config, ConfigError, clip_warmup, load_config

RECIPES = Path(__file__).resolve().parents[2] / "configs"


def recipe_path(name: str | None) -> Path | None:
    """A path as given, or a recipe name from configs/; none given means the default recipe."""
    if name is None:
        default = RECIPES / "default.toml"
        return default if default.is_file() else None
    path = Path(name)
    if not path.exists() and (RECIPES / f"{name}.toml").is_file():
        return RECIPES / f"{name}.toml"
    return path

def check_output_path(path: str, option: str = "--metrics", folder: bool = False) -> None:
    """A file (or, `folder`, a directory) that can be created (or overwritten) and written."""
    target = Path(path)
    if target.is_dir() != folder and target.exists():
        raise ConfigError(option, f"{target} is a {'file' if folder else 'directory'}; name a "
                          f"{'folder' if folder else 'file in it'}")
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(option, f"{ancestor} is a file, so {target} cannot be created; "
                          "choose another path")
    writable = os.access(target, os.W_OK) if target.exists() else os.access(ancestor, os.W_OK)
    if writable and not target.exists():
        problem = creatable(target, ancestor, folder)
        if problem:
            raise ConfigError(option, f"{target} cannot be created ({problem}); choose another "
                              "path")
    if not writable:
        raise ConfigError(option, f"{target} is not writable here; choose another path")

def in_torchrun() -> bool:
    """True inside a worker started by torchrun (or by plait's launcher)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE"} <= os.environ.keys()


def load(args: argparse.Namespace, say: bool = True) -> Config:
    """The configuration of a command: recipe, overrides, warm-up clipped to a short run (said
    once, on stderr)."""
    cfg, note = clip_warmup(load_config(recipe_path(args.config), args.overrides))
    if note and say:
        print(f"plait: note: {note}", file=sys.stderr)
    return cfg
