"""A corpus of token ids read through memory maps: no rank holds it, and host memory does not grow
with it (the page cache holds what is read; a process's own memory holds one batch).

Sources, all seen as one stream of token ids cut into segments (one memory map each):
- a folder written by `plait data prepare` (`manifest.json`, shards of uint16 / uint32 ids and
  `documents.npy`, each document's first position in the stream);
- a `.bin` of uint16 ids (one segment, documents unknown);
- text: a file, a folder, or "stdlib" (Python's own .py files); each byte is a token and each file
  a document (one segment each, empty files skipped).

The validation split is whole documents at the end (Megatron splits by documents too): those after
the document boundary nearest to the last `val_fraction` of the tokens. A source of one document
(a text file, a `.bin`) splits its last tokens.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import mmap
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
INDEX = "documents.npy"  # int64: each document's first position, then the number of tokens
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SHARD_TOKENS = 1 << 28  # ids per shard file that `plait data prepare` writes (512 MiB of uint16)


class CorpusError(ValueError):
    """A source that cannot be read as promised; `key` is the setting to change."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


def text_files(root: Path) -> list[Path]:
    """Files under `root` in a fixed order, skipping installed packages and caches."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        files += [Path(dirpath, f) for f in sorted(filenames)]
    return files


def files_of(path: Path) -> list[Path]:
    """A folder's files (`text_files`), or the file itself."""
    return text_files(path) if path.is_dir() else [path]


def stdlib_files() -> list[Path]:
    """Python's own standard library: its .py files, in a fixed order (`data.source = stdlib`)."""
    return [f for f in text_files(Path(sysconfig.get_paths()["stdlib"])) if f.suffix == ".py"]


def is_prepared(source: str) -> bool:
    return Path(source, MANIFEST).is_file()


def read_manifest(folder: Path) -> dict:
    """The folder's manifest, checked against what `plait data prepare` writes (types, a known
    dtype wide enough for the vocabulary, each shard a file of this folder whose bytes are its
    ids' count times the dtype's width): a corrupt one is refused here, not in a worker."""
    where = folder / MANIFEST
    try:
        manifest = json.loads(where.read_text())
        problem = _manifest_problem(manifest)
    except (OSError, ValueError) as e:
        problem = str(e)
    if problem:
        raise CorpusError("data.source", f"{where} is not a plait manifest ({problem}); "
                          "prepare the folder again with `plait data prepare`")
    return manifest


def _whole(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _manifest_problem(m) -> str | None:
    if not isinstance(m, dict):
        return "not a JSON object"
    if not _whole(m.get("vocab_size"), 1):
        return f"vocab_size {m.get('vocab_size')!r} is not a whole number >= 1"
    if m.get("dtype") not in DTYPES:
        return f"dtype {m.get('dtype')!r} is not one of {', '.join(DTYPES)}"
    width = np.dtype(DTYPES[m["dtype"]]).itemsize
    if m["vocab_size"] > 1 << (8 * width):
        return f"dtype {m['dtype']} cannot hold ids up to vocab_size {m['vocab_size']}"
    shards = m.get("shards")
    if not isinstance(shards, list) or not shards:
        return "shards is not a list of shards"
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict):
            return f"shards[{i}] is not an object"
        name = shard.get("file")
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            return f"shards[{i}].file {name!r} is not a file name in the folder"
        if not _whole(shard.get("tokens")) or shard.get("bytes") != shard["tokens"] * width:
            return (f"shards[{i}]: tokens {shard.get('tokens')!r} and bytes "
                    f"{shard.get('bytes')!r} disagree with dtype {m['dtype']}")
        if not isinstance(shard.get("sha256"), str):
            return f"shards[{i}] has no sha256"
    if not any(shard["tokens"] for shard in shards):
        return "its shards hold no token"
    if not _whole(m.get("documents"), 1) or m.get("tokens") != sum(s["tokens"] for s in shards):
        return (f"documents {m.get('documents')!r} and tokens {m.get('tokens')!r} are not whole "
                "numbers, or tokens is not the sum of its shards'")
    return None


SAMPLE_IDS = 4096  # ids per sampled block


def verify_shards(folder: Path, manifest: dict, checksums: bool = False,
                  key: str = "data.source") -> None:
    """Every shard present and of its recorded size, and a few blocks of its ids below the
    vocabulary (`sample_ids`): what a launch checks, in time independent of the corpus's size.
    With `checksums` (`plait data verify`), each shard read whole (~1 GB/s): its sha256 and
    every id."""
    for shard in manifest["shards"]:
        path = folder / shard["file"]
        if not path.is_file():
            raise CorpusError(key, f"shard {path} is missing; prepare {folder} again")
        size = path.stat().st_size
        if size != shard["bytes"]:
            raise CorpusError(key, f"shard {path} has {size} bytes, the manifest says "
                              f"{shard['bytes']} (truncated?); prepare {folder} again")
        ids = _map(path, DTYPES[manifest["dtype"]]) if shard["tokens"] else None
        if ids is None:
            continue
        sample_ids(ids, manifest["vocab_size"], str(path), key,
                   blocks=None if checksums else 2)
        if not checksums:
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        if digest.hexdigest() != shard["sha256"]:
            raise CorpusError(key, f"shard {path} fails its checksum (sha256 differs from the "
                              f"manifest's); prepare {folder} again")
    read_index(folder, manifest, key, whole=checksums)


def read_index(folder: Path, manifest: dict, key: str = "data.source",
               whole: bool = False) -> np.ndarray | None:
    """The documents' first positions (`INDEX`), memory-mapped, as prepare writes them: int64,
    one per document and the total last, from 0 to the manifest's tokens, never decreasing (in
    a few sampled blocks; `whole`: all of it). None where the folder has none."""
    path = folder / INDEX
    if not path.is_file():
        return None
    try:
        starts = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:  # not an .npy, a pickle, truncated
        raise CorpusError(key, f"{path} does not read as an index of documents ("
                          f"{str(e).splitlines()[0][:120]}); prepare {folder} again") from None
    shape = (manifest["documents"] + 1,)
    if starts.dtype != np.int64 or starts.shape != shape or starts[0] != 0 \
            or starts[-1] != manifest["tokens"]:
        raise CorpusError(key, f"{path} is not the index of the manifest's documents (want "
                          f"{shape[0]} int64 positions from 0 to {manifest['tokens']}, got "
                          f"{starts.dtype} of shape {starts.shape}); prepare {folder} again")
    n = len(starts)
    blocks = [0] if whole or n <= 4 * SAMPLE_IDS else \
        np.linspace(0, n - SAMPLE_IDS, 4, dtype=np.int64).tolist()
    for at in blocks:
        piece = starts[at : n if whole else at + SAMPLE_IDS]
        if len(piece) > 1 and np.any(np.diff(piece) < 0):
            where = at + int(np.argmax(np.diff(piece) < 0))
            raise CorpusError(key, f"{path}: document {where + 1} starts before document "
                              f"{where} (damaged); prepare {folder} again")
    return starts


def sample_ids(ids: np.ndarray, limit: int, name: str, key: str,
               blocks: int | None = 2) -> None:
    """`blocks` blocks of `SAMPLE_IDS` ids spread over `ids` (its first, its last, evenly
    between; None: all of them) below `limit`, or a one-line error naming where."""
    n = len(ids)
    if blocks is None or n <= blocks * SAMPLE_IDS:
        starts = range(0, n, 1 << 24)
        size = 1 << 24
    else:
        starts = np.linspace(0, n - SAMPLE_IDS, blocks, dtype=np.int64).tolist()
        size = SAMPLE_IDS
    for at in starts:
        beyond(ids[at : at + size], at, limit, name, key)


def beyond(piece: np.ndarray, at: int, limit: int, name: str, key: str) -> None:
    """Raise, naming the first id of `piece` (ids `at`... of `name`) at or over `limit`."""
    if len(piece) and int(piece.max()) >= limit:
        where = int(np.argmax(piece >= limit))
        raise CorpusError(key, f"token id {int(piece[where])} at id {at + where} of {name} is "
                          f">= {limit} (the vocabulary): damaged or not ids there")


@dataclass
class Corpus:
    """Token ids as segments of one stream; `starts` are the documents' first positions (with the
    stream's length last), or None where documents are unknown."""

    segments: list[np.ndarray]
    starts: np.ndarray | None
    vocab_size: int  # ids are below it
    note: str = ""  # a limit the user asked for, said once by whoever opens the corpus first
    names: list[str] | None = None  # each segment's file, for a damaged id's message

    def __post_init__(self):
        self.ends = np.cumsum([len(s) for s in self.segments], dtype=np.int64)
        self.tokens = int(self.ends[-1]) if len(self.ends) else 0
        self._ends = self.ends.tolist()  # bisect on a list: a row's lookup in ~1 us

    def split(self, val_fraction: float) -> int:
        """The first position of the validation split: the last `val_fraction` of the tokens,
        moved to the nearest document boundary (whole documents, at least one on each side); by
        tokens alone where there is one document."""
        cut = self.tokens - int(self.tokens * val_fraction)
        docs = 0 if self.starts is None else len(self.starts) - 1
        if docs < 2:
            return cut
        at = int(np.searchsorted(self.starts, cut))  # starts[at - 1] < cut <= starts[at]
        nearest = min((a for a in (at - 1, at) if 1 <= a < docs),
                      key=lambda a: abs(int(self.starts[a]) - cut))
        return int(self.starts[nearest])

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows of `length` consecutive ids from each start: (len(starts), length) int64; a row may
        cross segments."""
        out = np.empty((len(starts), length), dtype=np.int64)
        ends = self._ends
        for row, start in enumerate(np.asarray(starts, dtype=np.int64).tolist()):
            at, filled = bisect.bisect_right(ends, start), 0
            offset = start - (ends[at - 1] if at else 0)
            while filled < length:
                piece = self.segments[at][offset : offset + length - filled]
                beyond(piece, offset, self.vocab_size,  # every id checked as it is read
                       self.names[at] if self.names else f"segment {at}", "data.source")
                out[row, filled : filled + len(piece)] = piece
                filled, at, offset = filled + len(piece), at + 1, 0
        return out


def _limit(segments: list[np.ndarray], max_bytes: int, what: str,
           total: int | None = None) -> tuple[list, str]:
    """The segments cut to their first `max_bytes` bytes (of `total`, theirs by default), and the
    sentence that says so."""
    total = sum(s.nbytes for s in segments) if total is None else total
    if not max_bytes or max_bytes >= total:
        return segments, ""
    kept, left = [], max_bytes
    for s in segments:
        if left < s.itemsize:
            break
        kept.append(s[: left // s.itemsize])
        left -= kept[-1].nbytes
    return kept, (f"data.max_bytes = {max_bytes:,}: training on the first {max_bytes:,} of "
                  f"{total:,} bytes of {what}")


def _map(path: Path, dtype) -> np.ndarray:
    """A read-only view of the file's ids, paged in on use (mmap without np.memmap's overhead,
    which matters for the standard library's 1,800 files)."""
    with open(path, "rb") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=dtype)


def open_corpus(source: str, max_bytes: int = 0) -> Corpus:
    """The corpus at `source`, memory-mapped; `max_bytes` (0: all) keeps the first bytes only."""
    path = Path(source)
    if is_prepared(source):
        manifest = read_manifest(path)
        dtype = DTYPES[manifest["dtype"]]
        shards = [s for s in manifest["shards"] if s["tokens"]]
        segments = [_map(path / s["file"], dtype) for s in shards]
        starts = read_index(path, manifest)
        segments, note = _limit(segments, max_bytes, source)
        if note:  # documents past the cut are gone; the one cut short ends the stream
            kept = sum(len(s) for s in segments)
            starts = np.append(starts[starts < kept], kept) if starts is not None else None
        return Corpus(segments, starts, int(manifest["vocab_size"]), note,
                      [str(path / s["file"]) for s in shards])
    if source.endswith(".bin"):
        segments, note = _limit([_map(path, np.uint16)], max_bytes, source)
        return Corpus(segments, None, 1 << 16, note, [source])
    files = stdlib_files() if source == "stdlib" else files_of(path)
    sizes = np.cumsum([f.stat().st_size for f in files])
    if max_bytes:  # map only the files the limit reaches
        files = files[: int(np.searchsorted(sizes, max_bytes)) + 1]
    segments = [_map(f, np.uint8) for f in files if f.stat().st_size]
    segments, note = _limit(segments, max_bytes, source, total=int(sizes[-1]) if files else 0)
    starts = np.cumsum([0] + [len(s) for s in segments], dtype=np.int64)
    return Corpus(segments, starts, 256, note)
