"""Batches as a model takes them: a tensor, a tuple of tensors, or a dict of them (keyword
arguments: `input_ids`, `attention_mask`, `labels`, ...), and outputs that carry their own loss.

A batch's tensors share dim 0 (rows); data parallelism splits every tensor of the structure along
it, micro-batching splits it again. A `Call` is one micro-batch's arguments for the first chunk's
forward; its loss is the user's `loss_fn(output, target)` when a target is given, else the one the
model computed itself (`model_loss`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor in a nested structure of tuples, lists and mappings (a transformers
    `ModelOutput` is a mapping), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def split_rows(obj, parts: int, what: str = "batch") -> list:
    """`obj` (a tensor or a structure of them, each with the same number of rows) cut into
    `parts` equal pieces of rows; other values are repeated in every piece."""
    lengths = {len(t) for t in tensors_in(obj)}
    if len(lengths) > 1:
        raise ValueError(f"{what}: its tensors have different numbers of rows {sorted(lengths)}; "
                         "every tensor of a batch holds the same rows along dim 0")
    if lengths and next(iter(lengths)) % parts:
        raise ValueError(f"{what}: {next(iter(lengths))} rows do not split into {parts} equal "
                         "parts; use a multiple")

    def cut(v):
        if isinstance(v, torch.Tensor):
            return v.chunk(parts)
        if isinstance(v, Mapping):
            pieces = {k: cut(x) for k, x in v.items()}
            return [{k: p[i] for k, p in pieces.items()} for i in range(parts)]
        if isinstance(v, (tuple, list)):
            pieces = [cut(x) for x in v]
            return [type(v)(p[i] for p in pieces) for i in range(parts)]
        return [v] * parts

    return list(cut(obj))


def to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


@dataclass
class Call:
    """A micro-batch's arguments for the model's forward: `model(*args, **kwargs)`."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __call__(self, module, device: torch.device):
        return module(*to_device(self.args, device), **to_device(self.kwargs, device))


def model_loss(output) -> torch.Tensor:
    """The loss a model computed itself: a scalar output, an output's `.loss` (transformers'
    `ModelOutput`), or its "loss" entry."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"the model's output ({type(output).__name__}) carries no loss (a "
                         "scalar, `.loss` or a 'loss' entry); give the batch what the model needs "
                         "to compute one (e.g. labels), or pass a loss_fn")
    return loss


def as_microbatches(batch, rank: int, ranks: int, microbatches: int,
                    own_loss: bool) -> list[tuple[Call, object]]:
    """Rank `rank`'s micro-batches (of `ranks` that split the rows) of a global batch as the
    model takes it: (the call, the target: None where the model computes its own loss). A
    tensor is the model's input; a tuple its arguments, the last one the target given a loss
    function; a dict its keyword arguments, and the target whole given one."""
    local = split_rows(batch, ranks, "batch")[rank]
    out = []
    for piece in split_rows(local, microbatches, "batch per rank"):
        if isinstance(piece, torch.Tensor):
            out.append((Call((piece,)), None if own_loss else piece))
        elif isinstance(piece, Mapping):
            out.append((Call((), dict(piece)), None if own_loss else piece))
        elif isinstance(piece, (tuple, list)):
            out.append((Call(tuple(piece)), None) if own_loss
                       else (Call(tuple(piece[:-1])), piece[-1]))
        else:
            raise TypeError(f"a batch is a tensor, a tuple or a dict, not "
                            f"{type(batch).__name__}")
    if isinstance(batch, torch.Tensor) and not own_loss:
        raise ValueError("a batch of one tensor has no targets for loss_fn; pass (inputs, "
                         "targets), or let the model compute its loss (loss_fn=None)")
    return out
