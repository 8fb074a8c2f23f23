"""Sharded checkpoints with `torch.distributed.checkpoint` (DCP): each rank writes only what it
holds, as boxes of the global tensors (`layout.py`), so any layout loads on any other.

A checkpoint is a folder `step-NNNNNNNN` (the number of optimizer steps done) holding

- DCP's shard files and `.metadata`: `model.<name>` (the parameters the optimizer steps: fp32
  masters under bf16), `optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>`, `optim.step` (AdamW's
  step count), `train.step`, `rng` (the CPU generator's state), with a compression method
  its state: `compression.error.<name>`, `compression.q.<name>` (`compression.py`), and under
  fp16 the loss scaler's: `train.loss_scale`, `train.loss_scale_growth_tracker`,
  `train.loss_scale_hysteresis_left`, `train.skipped_steps` (`parallel/loss_scaling.py`);
- `plait.json`: the step, the configuration and world it was made with, and what it contains
  (a Hugging Face import holds the model alone);
- `COMPLETE`, written last by rank 0 once DCP has gathered every rank's write results and
  written its metadata. A folder without it is ignored: a crash during a save leaves the previous
  checkpoint the newest complete one.

The data position needs no state: a step's batch is a function of the step (`train/data.py`).
Loading runs nothing a checkpoint holds: DCP's `.metadata` is unpickled against an allow-list of
the classes it is made of (`metadata.py`), tensors by `torch.load(weights_only=True)`, and
`plait.json` is JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from plait.checkpoint.compression import compression_state
from plait.checkpoint.layout import Boxes, LoadBoxes, boxes_of
from plait.checkpoint.metadata import CheckpointReader, read_metadata

MARKER = "COMPLETE"
META = "plait.json"
PREFIX = "step-"
MOMENTS = ("exp_avg", "exp_avg_sq")


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


def read_meta(path: str | Path) -> dict:
    return json.loads((Path(path) / META).read_text())


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


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state as its first step would create it (zero moments, step 0), so that a
    checkpoint can be read into it before any step."""
    for group in optimizer.param_groups:
        if group.get("capturable") or group.get("fused") or group.get("amsgrad"):
            raise NotImplementedError("checkpoints hold AdamW state of the plain kind only")
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                for key in MOMENTS:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def training_state(par, optimizer: torch.optim.Optimizer, step: int = 0,
                   with_optimizer: bool = True) -> dict:
    """This rank's part of the checkpoint, as views of its memory: DCP saves from it and loads
    into it. `par` is a `plait.parallel.Parallelized`."""
    pieces = defaultdict(list)
    for piece in par.engine.held_pieces():
        pieces[piece.name].append(piece)
    sd: dict[str, Boxes | torch.Tensor] = {}
    sources = {"model": lambda piece: piece.tensor}
    if with_optimizer:
        init_optimizer_state(optimizer)
        for key in MOMENTS:
            sources[f"optim.{key}"] = lambda piece, key=key: optimizer.state[piece.tensor][key]
    for name, held in pieces.items():
        place = par.record.params[name]
        for prefix, source in sources.items():
            sd[f"{prefix}.{name}"] = boxes_of([(p, source(p)) for p in held], place.shape,
                                              place.local_shape, place.origin)
    sd["train.step"] = torch.tensor(step, dtype=torch.int64)
    if with_optimizer:
        first = next(iter(optimizer.state.values()))
        sd["optim.step"] = first["step"].detach().clone()
        sd["rng"] = torch.get_rng_state()
        sd.update(compression_state(par)[0])
        if par.scaler is not None:
            sd.update(par.scaler.state_tensors())
    return sd


def load(path: str | Path, par, optimizer: torch.optim.Optimizer,
         group: dist.ProcessGroup | None = None) -> int:
    """Read a checkpoint made on any layout into this rank's part of the model and optimizer;
    returns the step to continue from (0 for a checkpoint of the model alone)."""
    full = "optim" in read_meta(path)["contents"]
    sd = training_state(par, optimizer, with_optimizer=full)
    if full:  # compression's entries as they were saved (see compression.py)
        sizes = saved_sizes(path)
        sd = {k: v for k, v in sd.items() if not k.startswith("compression.")}
        entries, compression_loaded = compression_state(par, sizes)
        sd.update(entries)
        if par.scaler is not None and "train.loss_scale" not in sizes:
            # A checkpoint of an fp32 or bf16 run: fp16 starts its scale afresh.
            sd = {k: v for k, v in sd.items() if k not in par.scaler.state_tensors()}
    dcp.load(sd, storage_reader=CheckpointReader(str(path)), planner=LoadBoxes(),
             process_group=group)
    if full:
        for state in optimizer.state.values():
            state["step"].copy_(sd["optim.step"])
        torch.set_rng_state(sd["rng"])
        compression_loaded()
        if par.scaler is not None and "train.loss_scale" in sd:
            par.scaler.load_state_tensors(sd)
        if par.engine.compression is not None:  # its start counts optimizer steps
            par.engine.compression.steps = int(sd["train.step"])
    # Masters into the bf16 parameters; ZeRO-1/2 gather every slice back into each replica.
    par.finish_step()
    return int(sd["train.step"]) if full else 0


@contextlib.contextmanager
def one_process():
    """DCP in this process alone, without its warning that this is so (the point here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


def saved_sizes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The size of every tensor a checkpoint holds, by key."""
    saved = read_metadata(path).state_dict_metadata
    return {k: tuple(v.size) for k, v in saved.items() if hasattr(v, "size")}


def load_full(path: str | Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The whole tensors whose keys start with `prefix`, read in this process alone (no process
    group): what `plait convert` and the tests read a checkpoint with."""
    saved = read_metadata(path).state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in saved.items()
          if k.startswith(prefix)}
    with one_process():
        dcp.load(sd, storage_reader=CheckpointReader(str(path)), planner=LoadBoxes(),
                 no_dist=True)
    return {k[len(prefix):]: v for k, v in sd.items()}


def meta(cfg, step: int, world_size: int, contents=("model", "optim", "train")) -> dict:
    return {"step": step, "world_size": world_size, "contents": list(contents),
            "config": cfg.to_dict()}
