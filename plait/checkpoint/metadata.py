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

Every path that reads a checkpoint goes through `CheckpointReader` (resume, `plait convert`,
`load_full`) and the launcher reads the metadata of the checkpoint it would resume before any
worker starts, so a crafted file is refused in one line naming it.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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
    return metadata


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
