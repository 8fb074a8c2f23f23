"""Models bigger than one device: built on `meta` (shapes, no storage), then each rank
materializes only what it holds.

`parallelize` cuts a `meta` model as it cuts a real one (pipeline stages, tensor-parallel slices,
experts): the placement record then says, for every parameter the rank holds, which box of the
whole tensor that is (`ParamPlacement.origin`, `.local_shape`). A `Source` produces any rows of any
whole tensor without producing the rest, and from them the box (`box`) or, for a ZeRO-3 slice,
just the elements of the box that the rank's flat slice covers (`elements`). Two sources:

- `NamedInit`: plait's Llama init, drawn in blocks of rows per tensor (`llama.init_rows`), so a
  slice equals the slice of a one-process init with the same seed;
- `SafetensorsFile`: a Hugging Face folder's weights, each rank reading its rows through
  `safe_open(...).get_slice` (the file is memory-mapped; nothing else is read), a stacked
  experts tensor assembled from the file's per-expert tensors of the experts the rank holds, a
  fused projection's part from its rows of the fused tensor, a Conv1D's weight from its columns.

So no rank holds a tensor it does not hold in training, and the weights equal a one-process
build's from step 0. Replicas are equal by construction (the same seed and name, or the same
file), so nothing is broadcast.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn


class Box(Protocol):
    """The part of a whole tensor a rank holds: a box of `local_shape` at `origin` of `shape`
    (`plait.parallel.placement.ParamPlacement` is one; the model layer names no parallelism)."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def local_shape(self) -> tuple[int, ...]: ...
    @property
    def origin(self) -> tuple[int, ...]: ...
    @property
    def local_numel(self) -> int: ...


@contextlib.contextmanager
def params_on_meta():
    """Build modules with their parameters on `meta` and their buffers where the ambient device
    puts them (rotary tables and masks are computed, not stored)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def is_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


class Source:
    """Where a parameter's values come from, rows at a time."""

    device = torch.device("cpu")

    def rows(self, name: str, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of dim 0 of the whole tensor `name` (of `shape`), fp32 on the CPU."""
        raise NotImplementedError

    def box(self, name: str, placement: Box) -> torch.Tensor:
        """The part of `name` a rank holds (its placement's box), on `self.device`."""
        return self.elements(name, placement, 0, placement.local_numel).view(
            placement.local_shape)

    def elements(self, name: str, placement: Box, start: int, n: int) -> torch.Tensor:
        """Elements [start, start + n) of the rank's box of `name`, flattened; only the rows
        that hold them are produced."""
        local, origin, shape = placement.local_shape, placement.origin, placement.shape
        row = math.prod(local[1:])
        first, last = start // row, -(-(start + n) // row)  # the box's rows that hold them
        rows = self.rows(name, shape, origin[0] + first, origin[0] + last)
        for dim in range(1, len(shape)):  # the box's columns
            if local[dim] != shape[dim]:
                rows = rows.narrow(dim, origin[dim], local[dim])
        flat = rows.reshape(-1)[start - first * row : start - first * row + n]
        return flat.to(self.device, copy=True)


class NamedInit(Source):
    """plait's Llama init (`llama.init_rows`): seeded by the run's seed and each name."""

    def __init__(self, seed: int, n_layers: int, device: torch.device | str = "cpu"):
        self.seed, self.n_layers, self.device = seed, n_layers, torch.device(device)

    def rows(self, name, shape, lo, hi):
        # here, not at the top: plait.model's package and shapes are read by the torch-free checks
        from plait.model.llama import init_rows

        return init_rows(self.seed, self.n_layers, name, shape, lo, hi)


@dataclass(frozen=True)
class Stacked:
    """A stacked-experts tensor (experts, ...) that a file stores one expert at a time: expert e
    is the concatenation along its first dim of the file's tensors `parts` (names with {e})."""

    parts: tuple[str, ...]


@dataclass(frozen=True)
class Rows:
    """Rows [start, start + count) of a file's tensor `key` (a fused projection's part: plait
    holds each part as a linear of its own, `plait/model/fused.py`), of its transpose where
    `transposed` (a `Conv1D`'s weight, which the file stores (in, out) and plait holds as a
    linear's (out, in)); `count` None: to the end."""

    key: str
    start: int = 0
    count: int | None = None
    transposed: bool = False


class SafetensorsFile(Source):
    """A Hugging Face folder's safetensors (one file or an index of shards), read by slices;
    `rename` maps plait's parameter names to the file's (a name, `Stacked` or `Rows`)."""

    def __init__(self, folder: str | Path, rename, device: torch.device | str = "cpu"):
        # here, not at the top: safetensors only for a Hugging Face folder
        from safetensors import safe_open

        self.rename, self.device = rename, torch.device(device)
        self.files, self.where = [], {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            handle = safe_open(str(path), framework="pt")
            self.files.append(handle)  # kept open: each is a memory map
            self.where.update({key: handle for key in handle.keys()})

    def shape(self, key: str | Stacked, experts: int = 0) -> tuple[int, ...] | None:
        """The whole tensor's shape as the file holds it (None: not all of it is there)."""
        if isinstance(key, Stacked):
            shapes = [self.shape(part.format(e=e)) for e in range(experts) for part in key.parts]
            if not experts or None in shapes:
                return None
            per = shapes[:len(key.parts)]
            return (experts, sum(s[0] for s in per), *per[0][1:])
        if isinstance(key, Rows):
            shape = self.shape(key.key)
            if shape is None:
                return None
            shape = shape[::-1] if key.transposed else shape
            count = shape[0] - key.start if key.count is None else key.count
            return (count, *shape[1:]) if key.start + count <= shape[0] else None
        return tuple(self.where[key].get_slice(key).get_shape()) if key in self.where else None

    def rows(self, name, shape, lo, hi):
        key = self.rename(name)
        if isinstance(key, Stacked):  # each expert of [lo, hi) assembled from its parts
            return torch.stack([torch.cat([self.rows_of(part.format(e=e), 0, None)
                                           for part in key.parts]) for e in range(lo, hi)])
        if isinstance(key, Rows):  # rows [lo, hi) of the part: its rows (or columns) in the file
            if key.key not in self.where:
                raise KeyError(f"{key.key} is in no safetensors file of the folder")
            part = self.where[key.key].get_slice(key.key)
            lo, hi = key.start + lo, key.start + hi
            return (part[:, lo:hi].t() if key.transposed else part[lo:hi]).float()
        return self.rows_of(key, lo, hi) if len(shape) else self.rows_of(key, None, None)

    def rows_of(self, key: str, lo: int | None, hi: int | None) -> torch.Tensor:
        if key not in self.where:
            raise KeyError(f"{key} is in no safetensors file of the folder")
        part = self.where[key].get_slice(key)
        return (part[:] if lo is None else part[lo:hi]).float()


class Filler:
    """`fill(name, start, n)` for the flat slices of ZeRO-3 (`flat.FlatParam`): elements of the
    box this rank holds of `name`, from `source`, placed by `record`."""

    def __init__(self, source: Source, record):
        self.source, self.record, self.device = source, record, source.device

    def __call__(self, name: str, start: int, n: int) -> torch.Tensor:
        return self.source.elements(name, self.record.params[name], start, n)


def swap_parameters(root: nn.Module, new: dict[int, nn.Parameter]) -> None:
    """Put `new[id(old)]` wherever `old` is registered under `root` (tied parameters stay tied),
    with the gradient hooks the transforms registered on `old` (tensor parallelism's all-reduce
    of a partial gradient)."""
    for module in root.modules():
        for key, p in module._parameters.items():
            if p is not None and id(p) in new:
                q = new[id(p)]
                if p._backward_hooks and q._backward_hooks is None:
                    q._backward_hooks = p._backward_hooks  # the setter registers them
                module._parameters[key] = q


@torch.no_grad()
def materialize(root: nn.Module, record, source: Source) -> None:
    """Every `meta` parameter under `root` becomes its box, from `source` (the placement record
    `record` says which box each name is)."""
    new = {}
    for name, p in root.named_parameters():
        if p.is_meta:
            new[id(p)] = nn.Parameter(source.box(name, record.params[name]),
                                      requires_grad=p.requires_grad)
    swap_parameters(root, new)
