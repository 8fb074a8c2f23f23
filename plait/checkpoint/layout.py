"""What a rank holds, as boxes of the global tensors: the layout `torch.distributed.checkpoint`
saves and reshards by.

A rank holds each parameter in one of three ways, all read off the placement record and the
data-parallel engine: whole (data parallelism, a pipeline stage's layers), as a tensor-parallel
slice along one dim, or as a ZeRO slice, which is a contiguous range of the flattened
(tensor-parallel) parameter. A range of a row-major tensor is a union of at most 2 * ndim - 1
rectangular boxes, each contiguous in memory (`range_boxes`), so every way is a list of boxes
(offset and size in the global tensor, and a view of the memory holding it). DCP writes each box
as a chunk; on load it reads into each box whatever parts of the saved chunks overlap it, which
is how a checkpoint made on one layout loads on any other.

`Boxes` speaks DCP's protocol for a tensor held in pieces (`__create_write_items__`,
`__create_chunk_list__`, as DTensor does); the planners below find a box's memory by its offset.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from plait.parallel.engines.state import Piece

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[Box, int]]:
    """Boxes covering elements [start, stop) of a row-major tensor of `shape`, in order, each with
    the flat index of its first element. Every box is contiguous in memory."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [(((start,), (stop - start,)), start)]
    row = math.prod(shape[1:])  # elements per index of dim 0
    first, last = start // row, (stop - 1) // row
    out: list[tuple[Box, int]] = []

    def within(i: int, lo: int, hi: int) -> None:  # a part of row i of dim 0
        for (offs, sizes), flat in range_boxes(shape[1:], lo - i * row, hi - i * row):
            out.append((((i, *offs), (1, *sizes)), flat + i * row))

    if start % row:  # a partial first row
        within(first, start, min(stop, (first + 1) * row))
        first += 1
    whole_end = last + 1 if stop % row == 0 else last  # rows [first, whole_end) are whole
    if whole_end > first:
        out.append((((first, *(0,) * (len(shape) - 1)), (whole_end - first, *shape[1:])),
                    first * row))
    if stop % row and last >= first:  # a partial last row
        within(last, max(start, last * row), stop)
    return out


class Boxes:
    """A global tensor of `size` of which this rank holds some boxes (views into its memory)."""

    def __init__(self, size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], torch.Tensor]]):
        self._size = torch.Size(size)
        self.boxes = boxes  # (offsets, view)
        self._by_offset = {tuple(offs): view for offs, view in boxes}

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offs)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offs), view.size()),
                    properties=TensorProperties(dtype=view.dtype),
                    size=self._size,
                ),
            )
            for offs, view in self.boxes
        ]

    def size(self) -> torch.Size:
        return self._size

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offs), view.size()) for offs, view in self.boxes]

    def at(self, offsets) -> torch.Tensor:
        return self._by_offset[tuple(offsets)]


def boxes_of(pieces: list[tuple[Piece, torch.Tensor]], shape: tuple[int, ...],
             local_shape: tuple[int, ...], origin: tuple[int, ...]) -> Boxes:
    """The boxes of one global tensor of `shape` that `pieces` hold: each piece's values are
    `source.view(-1)[lo:lo + numel]` (the parameter, or an optimizer state of the same layout);
    the rank's local tensor of `local_shape` sits at `origin` in the global one."""
    out = []
    for piece, source in pieces:
        flat = source.view(-1)[piece.lo : piece.lo + piece.numel]
        for (offs, sizes), at in range_boxes(local_shape, piece.start, piece.start + piece.numel):
            view = flat[at - piece.start : at - piece.start + math.prod(sizes)].view(sizes)
            out.append((tuple(o + g for o, g in zip(offs, origin, strict=True)), view))
    return Boxes(shape, out)


def _lookup(state_dict: dict, index: MetadataIndex):
    obj = state_dict[index.fqn]
    return obj.at(index.offset) if isinstance(obj, Boxes) else obj


class SaveBoxes(DefaultSavePlanner):
    """DCP's default save planner, finding the memory of a box by its offset; `before_write` is
    called as the writer asks for each item (where a test injects a crash during a save)."""

    def __init__(self, before_write: Callable[[], None] | None = None):
        super().__init__()
        self.before_write = before_write

    def resolve_data(self, write_item: WriteItem):
        if self.before_write is not None:
            self.before_write()
        return super().resolve_data(write_item)

    def lookup_object(self, index: MetadataIndex):
        return _lookup(self.state_dict, index)


class LoadBoxes(DefaultLoadPlanner):
    """DCP's default load planner, reading into the memory of a box found by its offset. (Its
    set-up would replace objects it does not know by None: `Boxes` are kept out of it.)"""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        boxes = {k: v for k, v in state_dict.items() if isinstance(v, Boxes)}
        rest = {k: v for k, v in state_dict.items() if k not in boxes}
        super().set_up_planner(rest, metadata, is_coordinator)
        self.state_dict.update(boxes)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)

    def load_bytes(self, read_item, value) -> None:
        # DCP's default would torch.load(weights_only=False) them: plait saves tensors only.
        raise ValueError(f"checkpoint entry '{read_item.dest_index.fqn}' is a pickled object, "
                         "which plait never saves; refusing to load it")
