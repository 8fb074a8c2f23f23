"""Reading a checkpoint's `.metadata` without running anything it holds.

`torch.distributed.checkpoint`'s file reader unpickles `.metadata` with `pickle.load`, so a
crafted file runs whatever it names on the machine that resumes or converts it. plait reads it
with an unpickler that resolves only the classes DCP's metadata is made of (its dataclasses, torch
dtypes, `torch.Size`, the layout and memory-format encodings, a path) and refuses any other name,
before building anything: torch's `weights_only` idea applied to the one file DCP leaves
unguarded. The tensors themselves DCP reads with `torch.load(weights_only=True)`.

plait never saves bytes objects (every entry is a tensor), and DCP loads a bytes entry with
`torch.load(weights_only=False)`: `BytesStorageMetadata` is left out of the list, so an entry of
that kind is refused too (and plait's load planner refuses bytes as a second guard).

What it builds is then checked as a schema, not only by its classes: every field of the type
DCP's dataclasses declare (a tensor entry's size and chunks, a chunk's offsets and sizes of its
dimensions, non-negative), and every storage entry a regular file inside the checkpoint, named by
a relative path (no `..`, nothing absolute, no link out): DCP joins the folder and that path, so
an absolute one would read tensor files anywhere. `.metadata` itself must be a regular file (a
FIFO would hang the read).

Every path that reads a checkpoint goes through `CheckpointReader` (resume, `plait convert`,
`load_full`), and the launcher (and convert) check the checkpoint before any worker starts
(`check_checkpoint`): the metadata as above, then every tensor item as the workers will read it
(`torch.load(weights_only=True)`, on the meta device: no data), so a crafted or damaged file is
refused in one line naming it.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import stat
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _create_file_view
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from plait.checkpoint import read_meta

METADATA = ".metadata"

# (module, name) -> what may be built from it. Nothing here runs code on construction: dataclasses
# filled field by field, torch.Size from a tuple, an enum by value, a path from a string.
_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "TensorProperties"),
    (_DCP, "ChunkStorageMetadata"), (_DCP, "MetadataIndex"), (_DCP, "StorageMeta"),
    (_DCP, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name, as torch.load's own list
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),  # Python >= 3.13
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(ValueError):
    """A checkpoint whose metadata names something plait will not build."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"{self.path} names {module}.{name}, which a checkpoint's "
                               "metadata does not hold; refusing to load it (it could run code)")

    def persistent_load(self, pid):
        raise UnsafeCheckpoint(f"{self.path} holds a persistent reference; refusing to load it")


def read_metadata(checkpoint: str | Path) -> Metadata:
    """DCP's metadata of `checkpoint` (a folder), or `UnsafeCheckpoint` naming the file."""
    path = Path(checkpoint) / METADATA
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the read
            raise UnsafeCheckpoint(f"{path} is not a regular file")
        data = path.read_bytes()
    except OSError as e:
        raise UnsafeCheckpoint(f"{path}: {e.strerror or e}") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), path).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # a truncated or garbled file: say so, whatever pickle raised
        raise UnsafeCheckpoint(f"{path} is not a checkpoint's metadata ({type(e).__name__}: "
                               f"{e})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata")
    _check_entries(metadata, path)
    _check_storage(metadata, Path(checkpoint), path)
    return metadata


def _dims(value, what: str, path: Path) -> None:
    if not isinstance(value, torch.Size) or any(type(d) is not int or d < 0 for d in value):
        raise UnsafeCheckpoint(f"{path}: {what} is not a size (non-negative integers)")


def _check_entries(metadata: Metadata, path: Path) -> None:
    """Each entry a tensor's: its properties, size and chunks of the types DCP declares."""
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise UnsafeCheckpoint(f"{path}: its entries are not a mapping of names")
    for name, entry in entries.items():
        what = f"entry {name!r}"[:80]
        if not isinstance(name, str) or not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpoint(f"{path}: {what} is not a named tensor's")
        props = entry.properties
        if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
            raise UnsafeCheckpoint(f"{path}: {what} has no tensor properties (a dtype)")
        _dims(entry.size, f"{what}'s size", path)
        if not isinstance(entry.chunks, list):
            raise UnsafeCheckpoint(f"{path}: {what}'s chunks are not a list")
        for chunk in entry.chunks:
            if not isinstance(chunk, ChunkStorageMetadata):
                raise UnsafeCheckpoint(f"{path}: {what} has a chunk that is not a chunk's")
            _dims(chunk.offsets, f"{what}'s chunk offsets", path)
            _dims(chunk.sizes, f"{what}'s chunk sizes", path)


def _check_storage(metadata: Metadata, folder: Path, path: Path) -> None:
    """Each storage entry a regular file inside `folder`, by a relative path, at a
    non-negative offset and length."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise UnsafeCheckpoint(f"{path}: its storage entries are not a mapping")
    root, checked = folder.resolve(), set()
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not name or os.path.isabs(name) or \
                ".." in Path(name).parts:
            raise UnsafeCheckpoint(f"{path}: a storage path {str(name)[:80]!r} is not a file "
                                   "name inside the checkpoint")
        for field in ("offset", "length"):
            value = getattr(info, field, None)
            if type(value) is not int or value < 0:
                raise UnsafeCheckpoint(f"{path}: storage {name!r} has no {field} (a "
                                       "non-negative integer)")
        if name in checked:  # many entries share a file
            continue
        checked.add(name)
        target = (folder / name).resolve()
        if root not in target.parents:
            raise UnsafeCheckpoint(f"{path}: storage {name!r} leads outside the checkpoint")
        if not target.is_file():
            raise UnsafeCheckpoint(f"{path}: storage {name!r} is not a regular file there")


def check_tensor_files(checkpoint: str | Path, metadata: Metadata) -> None:
    """Every storage entry of a checkpoint whose metadata `read_metadata` passed: its bytes
    inside its file, and a tensor that `torch.load(weights_only=True)` reads (the loader DCP's
    workers use), of the entry's dtype and the chunk's size. Only the items' zip directories and
    pickles are read (`map_location="meta"`: no tensor data), so the launcher checks a
    checkpoint of any size in well under a second a GB; a file whose bytes are not tensors is
    refused here in one line, not in the workers after launch."""
    folder = Path(checkpoint)
    with contextlib.ExitStack() as stack:
        files: dict[str, io.BufferedReader] = {}  # each opened once: many items share a file
        for index, info in metadata.storage_data.items():
            name = info.relative_path
            if name not in files:
                files[name] = stack.enter_context(open(folder / name, "rb"))
            f, size = files[name], os.fstat(files[name].fileno()).st_size
            where = f"{folder / name} (bytes {info.offset}-{info.offset + info.length})"
            if info.offset + info.length > size:
                raise UnsafeCheckpoint(f"{where}: past the end of the file ({size} bytes)")
            entry = metadata.state_dict_metadata.get(getattr(index, "fqn", None))
            if entry is None:
                raise UnsafeCheckpoint(f"{where}: stored for no entry of the metadata")
            _check_item(f, info, entry, index, where)


def _check_item(f, info, entry: TensorStorageMetadata, index, where: str) -> None:
    """One storage item: read through the view DCP's reader loads it through, on `meta`."""
    try:
        tensor = torch.load(_create_file_view(f, info.offset, info.length),
                            map_location="meta", weights_only=True)
    except Exception as e:  # not a zip, a pickle weights_only refuses, truncated
        raise UnsafeCheckpoint(f"{where} is not a tensor torch.load(weights_only=True) reads "
                               f"({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    chunk = [c.sizes for c in entry.chunks if c.offsets == getattr(index, "offset", None)]
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != entry.properties.dtype or \
            (chunk and tensor.shape != chunk[0]):
        raise UnsafeCheckpoint(f"{where}: not the {entry.properties.dtype} tensor of "
                               f"{index.fqn!r}'s chunk that the metadata names")


def check_checkpoint(checkpoint: str | Path) -> dict:
    """What a launch that resumes, or a convert, reads of `checkpoint` before any worker starts:
    `.metadata` as a schema (`read_metadata`), every tensor item (`check_tensor_files`), and
    plait.json with a plait train run's config; returns that config's model section. Raises
    `UnsafeCheckpoint` or `BadMeta`, each one line naming the file."""
    check_tensor_files(checkpoint, read_metadata(checkpoint))
    return dict(read_meta(checkpoint, model=True)["config"]["model"])


class CheckpointReader(FileSystemReader):
    """DCP's file reader, with `.metadata` read by `read_metadata` instead of `pickle.load`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: plait writes none
            raise UnsafeCheckpoint(f"{self.path}: per-rank metadata is not a plait checkpoint")
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
