"""What a checkpoint holds of a rank's training state, read and written through
`torch.distributed.checkpoint` (the folders themselves: `plait/checkpoint/__init__.py`)."""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from plait.checkpoint import read_meta
from plait.checkpoint.compression import compression_state
from plait.checkpoint.layout import Boxes, LoadBoxes, boxes_of
from plait.checkpoint.metadata import CheckpointReader, read_metadata
from plait.comm import all_reduce
from plait.optim.whole_matrices import WholeMatrices

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's
MOMENTUM = ("momentum_buffer",)  # Muon's and SGD's


def state_keys(group: dict) -> tuple[str, ...]:
    """The per-element state an optimizer group keeps for each tensor it steps."""
    if "betas" in group:
        return MOMENTS
    return MOMENTUM if group.get("momentum", 0) else ()


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The state as the first step would create it (AdamW: zero moments, step 0; Muon, SGD: a
    zero momentum, which their first step turns into the gradient's as a fresh one would), so
    that a checkpoint can be read into it before any step."""
    for group in optimizer.param_groups:
        if any(group.get(k) for k in ("capturable", "fused", "amsgrad", "dampening")):
            raise NotImplementedError("checkpoints hold AdamW, Muon and plain SGD state only")
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                if "betas" in group:
                    state["step"] = torch.tensor(0.0)
                for key in state_keys(group):
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def training_state(par, optimizer: torch.optim.Optimizer, step: int = 0,
                   with_optimizer: bool = True) -> dict:
    """This rank's part of the checkpoint, as views of its memory: DCP saves from it and loads
    into it. `par` is a `plait.parallel.Parallelized`."""
    pieces = defaultdict(list)
    for piece in par.engine.held_pieces():
        pieces[piece.name].append(piece)
    sd: dict[str, Boxes | torch.Tensor] = {}
    for piece in par.engine.frozen_pieces():  # the model's, which no optimizer steps
        place = par.record.params[piece.name]
        sd[f"model.{piece.name}"] = boxes_of([(piece, piece.tensor)], place.shape,
                                             place.local_shape, place.origin)
    elementwise, whole = _split(optimizer)
    if with_optimizer and elementwise is not None:
        init_optimizer_state(elementwise)
    keys = {id(p): state_keys(g) for g in (elementwise.param_groups if elementwise else [])
            for p in g["params"]}
    keys.update({id(t): () for t in (whole.held if whole else [])})  # theirs: `whole_state`
    for name, held in pieces.items():
        place = par.record.params[name]
        sources = {"model": lambda piece: piece.tensor}
        if with_optimizer:  # the state of the group that steps it (Muon's matrices, AdamW's)
            if id(held[0].tensor) not in keys:
                raise ValueError(f"{name}: what this rank holds of it is in no group of the "
                                 "optimizer: build the optimizer over the job's parameters() "
                                 "(with prepare(whole=...): job.optimizer(...))")
            for key in keys[id(held[0].tensor)]:
                sources[f"optim.{key}"] = lambda piece, k=key: optimizer.state[piece.tensor][k]
        for prefix, source in sources.items():
            sd[f"{prefix}.{name}"] = boxes_of([(p, source(p)) for p in held], place.shape,
                                              place.local_shape, place.origin)
    sd["train.step"] = torch.tensor(step, dtype=torch.int64)
    if with_optimizer:
        counted = [s["step"] for s in (elementwise.state.values() if elementwise else [])
                   if "step" in s]
        if counted:  # AdamW's step count (SGD's and Muon's momentum keep none)
            sd["optim.step"] = counted[0].detach().clone()
        sd.update(whole_state(whole))
        sd["rng"] = torch.get_rng_state()
        sd.update(compression_state(par)[0])
        if par.scaler is not None:
            sd.update(par.scaler.state_tensors())
    return sd


def _split(optimizer) -> tuple[torch.optim.Optimizer | None, WholeMatrices | None]:
    """(the optimizer of the tensors the engine holds, elementwise; the optimizer of whole
    matrices, `Prepared.optimizer`'s, or None)."""
    if isinstance(optimizer, WholeMatrices):
        return optimizer.rest, optimizer
    return optimizer, None


def whole_state(whole: WholeMatrices | None) -> dict[str, torch.Tensor]:
    """A `WholeMatrices`' state of the matrices this rank owns, by checkpoint key
    `whole.<optimizer class>.<state key>.<matrix>`: each whole, written by its owner (owners of
    one matrix in several replica groups hold the same state; DCP keeps one)."""
    if whole is None or whole.matrix_optimizer is None:
        return {}
    kind = type(whole.matrix_optimizer).__name__
    return {f"whole.{kind}.{key}.{m}": t for (m, key), t in whole.matrix_state().items()}


def _whole_key(key: str) -> tuple[str, str, str]:
    """(optimizer class, state key, matrix) of a `whole_state` checkpoint key."""
    _, kind, state_key, matrix = key.split(".", 3)
    return kind, state_key, matrix


def _whole_entries(path, saved: dict, whole: WholeMatrices | None, par,
                   group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Tensors to read the saved whole-matrix state of the matrices this rank owns into, as the
    checkpoint holds them (their shapes are the optimizer's, which a fresh one has not made yet).
    A ValueError, on every rank before anything is read, for a checkpoint of another kind of
    optimizer (only a matrix's owners know its optimizer's kind: they tell the others)."""
    if whole is None:
        if any(k.startswith("whole.") for k in saved):
            raise ValueError(f"{path} holds the state of an optimizer of whole matrices "
                             "(Prepared.optimizer): load it into one")
        return {}
    stepped_whole = {m.name for m in whole.exchange.matrices}
    for k in saved:
        name = k.split(".", 2)[-1]
        if k.startswith("optim.") and name in stepped_whole:
            raise ValueError(f"{path} holds an elementwise optimizer's state of {name}, which "
                             "this optimizer steps whole: load it into the optimizer it was "
                             "saved with")
    kind, out, kinds = type(whole.matrix_optimizer).__name__, {}, set()
    for k, v in saved.items():
        if not k.startswith("whole."):
            continue
        saved_kind, _, matrix = _whole_key(k)
        kinds.add(saved_kind)
        if matrix in whole.matrices:
            out[k] = torch.empty(v.size, dtype=v.properties.dtype,
                                 device=whole.matrices[matrix].device)
    other = torch.tensor([any(_whole_key(k)[0] != kind for k in out)], dtype=torch.int32,
                         device=next(par.module.parameters()).device)
    all_reduce(other, group, dist.ReduceOp.MAX)
    if other.item():
        raise ValueError(f"{path} holds {' and '.join(sorted(kinds))}'s state of the whole "
                         "matrices: load it into the optimizer it was saved with")
    return out


def load(path: str | Path, par, optimizer: torch.optim.Optimizer,
         group: dist.ProcessGroup | None = None) -> int:
    """Read a checkpoint made on any layout into this rank's part of the model and optimizer;
    returns the step to continue from (0 for a checkpoint of the model alone)."""
    # The metadata checked here first, so that a refusal is plait's one line on every torch
    # (DCP of torch 2.11 swallows its reader's error and asserts "metadata is None").
    saved = read_metadata(path).state_dict_metadata
    full = "optim" in read_meta(path)["contents"]
    elementwise, whole = _split(optimizer)
    sd = training_state(par, optimizer, with_optimizer=full)
    if full:  # compression's entries as they were saved (see compression.py)
        sizes = saved_sizes(saved)
        sd = {k: v for k, v in sd.items() if not k.startswith(("compression.", "whole."))}
        sd.update(_whole_entries(path, saved, whole, par, group))
        entries, compression_loaded = compression_state(par, sizes)
        sd.update(entries)
        if par.scaler is not None and "train.loss_scale" not in sizes:
            # A checkpoint of an fp32 or bf16 run: fp16 starts its scale afresh.
            sd = {k: v for k, v in sd.items() if k not in par.scaler.state_tensors()}
    frozen = [k for k in (f"model.{p.name}" for p in par.engine.frozen_pieces())
              if k not in saved]
    if frozen:  # a checkpoint written before plait saved them: the job's own values stay
        warnings.warn(f"{path} holds no {', '.join(k.removeprefix('model.') for k in frozen)} "
                      "(frozen parameters plait did not save before): they keep this job's "
                      "values", stacklevel=2)
        sd = {k: v for k, v in sd.items() if k not in frozen}
    dcp.load(sd, storage_reader=CheckpointReader(str(path)), planner=LoadBoxes(),
             process_group=group)
    if full:
        for state in elementwise.state.values() if elementwise else []:
            if "step" in state and "optim.step" in sd:
                state["step"].copy_(sd["optim.step"])
        torch.set_rng_state(sd["rng"])
        compression_loaded()
        if par.scaler is not None and "train.loss_scale" in sd:
            par.scaler.load_state_tensors(sd)
        if par.engine.compression is not None:  # its start counts optimizer steps
            par.engine.compression.steps = int(sd["train.step"])
    # Masters into the bf16 parameters; ZeRO-1/2 gather every slice back into each replica.
    par.finish_step()
    if whole is not None:  # its matrices from the pieces just read, its state as saved
        whole.load_matrix_state({_whole_key(k)[:0:-1]: t for k, t in sd.items()
                                 if k.startswith("whole.")})  # (matrix, state key)
    return int(sd["train.step"]) if full else 0


@contextlib.contextmanager
def one_process():
    """DCP in this process alone, without its warning that this is so (the point here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


def saved_sizes(saved: dict) -> dict[str, tuple[int, ...]]:
    """The size of every tensor a checkpoint holds, by key, from its metadata's
    `state_dict_metadata` (`read_metadata`)."""
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
