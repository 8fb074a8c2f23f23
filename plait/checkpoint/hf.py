"""Hugging Face Llama folders (safetensors + config.json), to and from plait checkpoints.

plait's model is a Llama with two differences of convention, undone here:
- names: `layers.0.attention.wq.weight` is `model.layers.0.self_attn.q_proj.weight`, and so on;
- rotary pairs: plait rotates features (2j, 2j + 1) of each head together (the original Llama
  code), Hugging Face features (j, j + head_dim / 2). The rows of the query and key projections
  are reordered per head accordingly (`_to_half`, `_to_interleaved`); everything else is equal.

Export reads a checkpoint of any layout whole, in one process; import writes a checkpoint of the
model alone (no optimizer state: training continues from step 0 with fresh AdamW moments).
Only safetensors and JSON are read: nothing is unpickled.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from plait.checkpoint import finish, meta, read_meta
from plait.checkpoint.hf_llama import (
    BUFFERS,
    NAMES,
    ROTATED,
    hf_config,
    model_overrides,
    names_problem,
    rename,
)
from plait.checkpoint.rank_state import load_full, one_process
from plait.config.schema import Config, ModelConfig, model_section
from plait.model.args import ModelArgs
from plait.model.families import family_for
from plait.model.hf import hf_tensors, read_config
from plait.model.llama import build_model


def _to_half(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head from interleaved pairs (0, 1), (2, 3)... to halves (0, hd/2)..."""
    return w.unflatten(0, (-1, head_dim // 2, 2)).transpose(1, 2).flatten(0, 2)


def _to_interleaved(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    return w.unflatten(0, (-1, 2, head_dim // 2)).transpose(1, 2).flatten(0, 2)


def export_transformers(checkpoint: str | Path, out: str | Path) -> Path:
    """Write `checkpoint` (any layout) of a `model.hf` run as a Hugging Face folder: its
    tensors under transformers' names, the source folder's config.json (and
    generation_config.json)."""
    source = Path(read_meta(checkpoint)["config"]["model"]["hf"])
    family = family_for(read_config(source))
    tensors = {n: t.contiguous() for n, t in hf_tensors(load_full(checkpoint), family).items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    dropped = [key for key in REMOTE_CODE_KEYS if config.pop(key, None) is not None]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if dropped:
        print(f"plait: note: {out}/config.json: dropped {', '.join(dropped)} (the source "
              f"folder's own code, which the export does not carry: transformers builds "
              f"{config.get('architectures', ['the model'])[0]} itself)", file=sys.stderr)
    if (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", out / "generation_config.json")
    return out


# config.json keys that make transformers import code from the folder (trust_remote_code).
REMOTE_CODE_KEYS = ("auto_map",)


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Write `checkpoint` (any layout) as a Hugging Face Llama folder (a `model.hf` run's: as
    the folder it came from)."""
    saved = read_meta(checkpoint)["config"]["model"]
    if "hf" in saved:
        return export_transformers(checkpoint, out)
    args = model_section(saved).args()
    tensors = {}
    for name, t in load_full(checkpoint).items():
        if name.endswith(ROTATED):
            t = _to_half(t, args.head_dim)
        tensors[rename(name, NAMES)] = t.contiguous()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(args), indent=1))
    return out


def _check_shapes(sd: dict, args: ModelArgs, hf_dir: Path) -> None:
    """The imported tensors, their names already checked (`hf_llama.names_problem`), are plait's
    Llama of `args` (no layer beyond its own), each of its shape; a one-line ValueError if not."""

    want = {f"model.{n}": tuple(p.shape)
            for n, p in build_model(args, seed=0, device="meta").named_parameters()}
    for name, t in sd.items():
        if name not in want:
            raise ValueError(f"{hf_dir}: {name.removeprefix('model.')} is not in the model "
                             "config.json describes")
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{hf_dir}: {name.removeprefix('model.')} is {tuple(t.shape)}, the "
                             f"model config.json describes has {want[name]}")


def import_hf(hf_dir: str | Path, out: str | Path) -> tuple[Path, dict]:
    """Write the Hugging Face Llama folder `hf_dir` as a plait checkpoint of the model alone;
    returns its path and the `model.*` settings to train it with."""
    hf_dir = Path(hf_dir)
    hf = json.loads((hf_dir / "config.json").read_text())
    overrides = model_overrides(hf)
    cfg = Config(model=ModelConfig("tiny", overrides))
    args = cfg.model.args()
    weights = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    problem = names_problem(set(weights), hf)
    if problem:
        raise ValueError(f"{hf_dir}: {problem}")
    if "lm_head.weight" not in weights and hf.get("tie_word_embeddings"):
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    back = {v: k for k, v in NAMES.items()}
    sd = {}
    for name, t in weights.items():
        if name.endswith(BUFFERS):
            continue
        mine = rename(name, back)
        t = t.float()
        if mine.endswith(ROTATED):
            t = _to_interleaved(t, args.head_dim)
        sd[f"model.{mine}"] = t.contiguous()
    _check_shapes(sd, args, hf_dir)
    sd["train.step"] = torch.tensor(0, dtype=torch.int64)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with one_process():
        dcp.save(sd, checkpoint_id=str(out), no_dist=True)
    finish(out, meta(cfg, 0, 1, contents=("model",)))
    return out, overrides
