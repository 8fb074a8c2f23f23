"""Sharded checkpoints with `torch.distributed.checkpoint` (DCP): each rank writes only what it
holds, as boxes of the global tensors (`layout.py`), so any layout loads on any other.

A checkpoint is a folder `step-NNNNNNNN` (the number of optimizer steps done) holding

- DCP's shard files and `.metadata`: `model.<name>` (the parameters the optimizer steps: fp32
  masters under bf16), `optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>`, `optim.step` (AdamW's
  step count), `train.step`, `rng` (the CPU generator's state), with a compression method
  its state: `compression.error.<name>`, `compression.q.<name>` (`compression.py`), and under
  fp16 the loss scaler's: `train.loss_scale`, `train.loss_scale_growth_tracker`,
  `train.loss_scale_hysteresis_left`, `train.skipped_steps` (`optim/loss_scaling.py`);
- `plait.json`: the step, the configuration and world it was made with, and what it contains
  (a Hugging Face import holds the model alone);
- `COMPLETE`, written last by rank 0 once DCP has gathered every rank's write results and
  written its metadata. A folder without it is ignored: a crash during a save leaves the previous
  checkpoint the newest complete one.

The data position needs no state: a step's batch is a function of the step (`data/batches.py`).
Loading runs nothing a checkpoint holds: DCP's `.metadata` is unpickled against an allow-list of
the classes it is made of (`metadata.py`), tensors by `torch.load(weights_only=True)`, and
`plait.json` is JSON.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

# The folders and their metadata, here; what reads and writes tensors (torch, DCP) is in
# `rank_state.py`, so that the checks before a launch find a checkpoint without importing torch.
MARKER = "COMPLETE"
META = "plait.json"
PREFIX = "step-"


def step_path(root: str | Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:08d}"


def is_complete(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints in `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def find(resume: str, root: str) -> Path | None:
    """The checkpoint `checkpoint.resume` names: "never" none; "auto" the newest complete one in
    `root` (none if there is none); a path: that checkpoint, or the newest complete one in it."""
    if resume == "never":
        return None
    if resume != "auto":
        root = resume
        if is_complete(resume):
            return Path(resume)
    if not root:
        return None
    found = complete_checkpoints(root)
    return found[-1] if found else None


class BadMeta(ValueError):
    """A checkpoint's plait.json that is not what plait writes."""


def read_meta(path: str | Path, model: bool = False) -> dict:
    """plait's own metadata of a checkpoint: a JSON object, its "contents" a list and its run's
    "config" an object where present (with a "model" section where `model`: `plait train`'s;
    the Python API's has none); `BadMeta` in one line otherwise."""
    file = Path(path) / META
    try:
        if not file.is_file():
            raise BadMeta(f"{file} is not a regular file")
        meta = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadMeta(f"{file} is not plait's metadata ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config", {}), dict) \
            or not isinstance(meta.get("contents", []), list):
        raise BadMeta(f"{file} is not plait's metadata (a JSON object with its run's config "
                      "and its contents)")
    if model and not isinstance(meta.get("config", {}).get("model"), dict):
        raise BadMeta(f"{file} is not plait's metadata of a `plait train` run (its config has "
                      "no model section)")
    return meta


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def finish(path: Path, meta: dict, keep: int = 0) -> None:
    """Mark a checkpoint complete (its metadata first, the marker last); with `keep`, delete all
    but the newest `keep` complete checkpoints, and unfinished ones older than this."""
    _write_atomic(path / META, json.dumps(meta, indent=1))
    _write_atomic(path / MARKER, "")
    if keep:
        complete = complete_checkpoints(path.parent)
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in path.parent.glob(PREFIX + "*"):
            if stale.name < path.name and not is_complete(stale):
                shutil.rmtree(stale, ignore_errors=True)


def meta(cfg, step: int, world_size: int, contents=("model", "optim", "train")) -> dict:
    return {"step": step, "world_size": world_size, "contents": list(contents),
            "config": cfg.to_dict()}
