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
import functools
import hashlib
import json
import mmap
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
INDEX = "documents.npy"  # int64: each document's first position, then the number of tokens
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SHARD_TOKENS = 1 << 28  # ids per shard file that `plait data prepare` writes (512 MiB of uint16)
CHECKSUMS = "checksums.npy"  # uint32: the crc32 of every block of every shard, shard by shard
BLOCK_BYTES = 1 << 16  # the checksummed block: what a training read verifies on first touch
SAMPLE_BLOCKS = 32  # blocks a launch verifies: the corpus's first, last, evenly between


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
    return list(_stdlib()[0])


@functools.cache
def _stdlib() -> tuple[tuple[Path, ...], tuple[int, ...]]:
    """The standard library's .py files and their sizes, listed once per process (and inherited
    by the processes it forks): walking and sizing its ~1,800 files took 0.1-0.3 s, at every
    open of the corpus by every rank. The standard library does not change under a process."""
    files = tuple(f for f in text_files(Path(sysconfig.get_paths()["stdlib"])) if f.suffix == ".py")
    return files, tuple(f.stat().st_size for f in files)


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
    if ("block_bytes" in m or "checksums" in m) and m.get("checksums") != CHECKSUMS:
        return f"checksums {m.get('checksums')!r} is not {CHECKSUMS}"
    if "block_bytes" in m and (not _whole(m["block_bytes"], width) or m["block_bytes"] % width):
        return f"block_bytes {m['block_bytes']!r} is not a whole number of {m['dtype']} ids"
    if not any(shard["tokens"] for shard in shards):
        return "its shards hold no token"
    if not _whole(m.get("documents"), 1) or m.get("tokens") != sum(s["tokens"] for s in shards):
        return (f"documents {m.get('documents')!r} and tokens {m.get('tokens')!r} are not whole "
                "numbers, or tokens is not the sum of its shards'")
    return None


SAMPLE_IDS = 4096  # ids per sampled block


def verify_shards(folder: Path, manifest: dict, checksums: bool = False,
                  key: str = "data.source", only: list[int] | None = None) -> str:
    """Every shard present and of its recorded size, then blocks of its ids against their crc32
    (`CHECKSUMS`) and below the vocabulary: at a launch `SAMPLE_BLOCKS` blocks spread over the
    corpus, in time independent of its size; with `checksums` (`plait data verify`; `only`: these
    shards) every shard read whole (~1 GB/s): its sha256, every block and every id. Returns a
    note where the corpus has no block checksums (prepared by an older plait), "" otherwise."""
    shards, dtype, vocab = manifest["shards"], DTYPES[manifest["dtype"]], manifest["vocab_size"]
    picked = range(len(shards)) if only is None else only
    for i in picked:
        _check_present(folder, shards[i], key)
    blocks = shard_blocks(folder, manifest, key)
    if checksums:
        for i in picked:
            _check_whole(folder / shards[i]["file"], shards[i]["sha256"], dtype, vocab,
                         blocks and blocks[i], key)
    elif blocks is None:
        for i in (i for i in picked if shards[i]["tokens"]):
            path = folder / shards[i]["file"]
            sample_ids(map_ids(path, dtype, scattered=True), vocab, str(path), key)
    else:
        for i, b in _sampled(blocks):
            blocks[i].verify(b, key)
            beyond(blocks[i].block(b), b * blocks[i].per, vocab, blocks[i].name, key)
    read_index(folder, manifest, key, whole=checksums)
    return "" if blocks is not None else (
        f"{folder} has no block checksums ({CHECKSUMS}: prepared by an older plait), so a launch "
        "checks its sizes and a sample of ids, and training every id's range but not its bytes; "
        "prepare it again to have every block read verified")


def _check_present(folder: Path, shard: dict, key: str) -> None:
    path = folder / shard["file"]
    if not path.is_file():
        raise CorpusError(key, f"shard {path} is missing; prepare {folder} again")
    size = path.stat().st_size
    if size != shard["bytes"]:
        raise CorpusError(key, f"shard {path} has {size} bytes, the manifest says "
                          f"{shard['bytes']} (truncated?); prepare {folder} again")


def _check_whole(path: Path, sha256: str, dtype, vocab: int, blocks: ShardBlocks | None,
                 key: str) -> None:
    """One sequential pass over a shard: its sha256, each block's crc32, every id's range."""
    digest, at = hashlib.sha256(), 0
    size = blocks.per * np.dtype(dtype).itemsize if blocks is not None else 1 << 16
    with open(path, "rb") as f:
        while chunk := f.read(size * 256):
            digest.update(chunk)
            for i in range(0, len(chunk), size) if blocks is not None else ():
                b = (at + i) // size
                if zlib.crc32(memoryview(chunk)[i : i + size]) != int(blocks.sums[b]):
                    raise blocks.changed(b, key)
            ids = np.frombuffer(chunk, dtype=dtype)
            beyond(ids, at // ids.itemsize, vocab, str(path), key)
            at += len(chunk)
    if digest.hexdigest() != sha256:
        raise CorpusError(key, f"shard {path} fails its checksum (sha256 differs from the "
                          f"manifest's); prepare {path.parent} again")


class ShardBlocks:
    """A shard's ids in checksummed blocks (`block_bytes` each, the last maybe shorter), each
    verified against its crc32 the first time a read touches it: a byte changed since `plait data
    prepare` stops the run where it is read, naming the shard and the block's offset."""

    def __init__(self, ids: np.ndarray, sums: np.ndarray, block_bytes: int, name: str):
        self.ids, self.sums, self.name = ids, sums, name
        self.per = block_bytes // ids.itemsize  # ids per block
        self.done = np.zeros(len(sums), dtype=bool)

    def check(self, offset: int, length: int, key: str = "data.source") -> None:
        """Ids `offset` ... `offset + length - 1` lie in verified blocks (verified now if not)."""
        for b in range(offset // self.per, (offset + max(length, 1) - 1) // self.per + 1):
            if not self.done[b]:
                self.verify(b, key)

    def block(self, b: int) -> np.ndarray:
        return self.ids[b * self.per : (b + 1) * self.per]

    def verify(self, b: int, key: str = "data.source") -> None:
        if zlib.crc32(self.block(b)) != int(self.sums[b]):
            raise self.changed(b, key)
        self.done[b] = True

    def changed(self, b: int, key: str) -> CorpusError:
        at = b * self.per * self.ids.itemsize
        end = min(at + self.per * self.ids.itemsize, self.ids.nbytes)
        return CorpusError(key, f"{self.name}: block {b} (bytes {at:,} to {end:,}) fails its "
                           f"checksum ({CHECKSUMS}): the shard changed since it was prepared; "
                           "prepare the corpus again (plait data verify reads every block)")


def shard_blocks(folder: Path, manifest: dict, key: str = "data.source") -> list | None:
    """Each shard's `ShardBlocks` (memory-mapped ids and checksums), in the manifest's order; None
    for a corpus prepared without block checksums."""
    if "block_bytes" not in manifest:
        return None
    size, shards, path = manifest["block_bytes"], manifest["shards"], folder / CHECKSUMS
    counts = [-(-shard["bytes"] // size) for shard in shards]
    try:
        sums = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise CorpusError(key, f"{path} does not read as block checksums ("
                          f"{str(e).splitlines()[0][:120]}); prepare {folder} again") from None
    if sums.dtype != np.uint32 or sums.shape != (sum(counts),):
        raise CorpusError(key, f"{path} holds {sums.dtype} of shape {sums.shape}, not the "
                          f"{sum(counts)} uint32 checksums of the manifest's shards; prepare "
                          f"{folder} again")
    ends = np.cumsum(counts).tolist()
    dtype = DTYPES[manifest["dtype"]]
    return [ShardBlocks(map_ids(folder / shard["file"], dtype, scattered=True) if shard["tokens"]
                        else np.empty(0, dtype), sums[end - n : end], size,
                        str(folder / shard["file"]))
            for shard, n, end in zip(shards, counts, ends, strict=True)]


def _sampled(blocks: list[ShardBlocks]) -> list[tuple[int, int]]:
    """`SAMPLE_BLOCKS` (shard, block) pairs spread evenly over the corpus's blocks, the first and
    the last among them."""
    counts = np.array([len(b.sums) for b in blocks], dtype=np.int64)
    total, ends = int(counts.sum()), np.cumsum(counts)
    picks = np.unique(np.linspace(0, total - 1, min(total, SAMPLE_BLOCKS)).astype(np.int64))
    shard = np.searchsorted(ends, picks, side="right")
    return [(int(i), int(g - (ends[i] - counts[i]))) for i, g in zip(shard, picks, strict=True)]


def read_index(folder: Path, manifest: dict, key: str = "data.source",
               whole: bool = False) -> np.ndarray | None:
    """The documents' first positions (`INDEX`), memory-mapped, as prepare writes them: int64,
    one per document and the total last, from 0 to the manifest's tokens, never decreasing (in
    a few sampled blocks; `whole`: all of it). None where the folder has none and was prepared
    by a plait older than the index; a folder with block checksums (newer than the index) that
    has none is damaged."""
    path = folder / INDEX
    if not path.exists() and (folder / CHECKSUMS).exists():
        raise CorpusError(key, f"{path} is missing (the documents' index, which the plait that "
                          f"wrote {folder} writes); prepare {folder} again")
    if not path.exists():
        return None
    if not path.is_file():
        raise CorpusError(key, f"{path} is not a regular file; prepare {folder} again")
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


def sample_ids(ids: np.ndarray, limit: int, name: str, key: str, blocks: int = 2) -> None:
    """`blocks` blocks of `SAMPLE_IDS` ids spread over `ids` (its first, its last, evenly
    between; all of it when that is no more) below `limit`, or a one-line error naming where."""
    n = len(ids)
    if n <= blocks * SAMPLE_IDS:
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
    blocks: list[ShardBlocks] | None = None  # each segment's checksummed blocks, if prepared so

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
                if self.blocks is not None:  # its bytes as prepared, then its ids' range
                    self.blocks[at].check(offset, len(piece))
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


def map_ids(path: Path, dtype, scattered: bool = False) -> np.ndarray:
    """A read-only view of the file's ids, paged in on use (mmap without np.memmap's overhead,
    which matters for the standard library's 1,800 files). `scattered`: read where touched and no
    more (MADV_RANDOM): training reads windows at random, around which the kernel would otherwise
    read megabytes ahead (8 MiB a window measured here)."""
    with open(path, "rb") as f:
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if scattered and hasattr(mmap, "MADV_RANDOM"):
        view.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(view, dtype=dtype)


def open_corpus(source: str, max_bytes: int = 0) -> Corpus:
    """The corpus at `source`, memory-mapped; `max_bytes` (0: all) keeps the first bytes only."""
    path = Path(source)
    if is_prepared(source):
        manifest = read_manifest(path)
        dtype = DTYPES[manifest["dtype"]]
        shards = [s for s in manifest["shards"] if s["tokens"]]
        blocks = shard_blocks(path, manifest)
        if blocks is None:
            segments = [map_ids(path / s["file"], dtype, scattered=True) for s in shards]
        else:  # one map per shard: the blocks' (whole, for their checksums), cut below
            blocks = [b for b, s in zip(blocks, manifest["shards"], strict=True) if s["tokens"]]
            segments = [b.ids for b in blocks]
        starts = read_index(path, manifest)
        segments, note = _limit(segments, max_bytes, source)
        if note:  # documents past the cut are gone; the one cut short ends the stream
            kept = sum(len(s) for s in segments)
            starts = np.append(starts[starts < kept], kept) if starts is not None else None
        return Corpus(segments, starts, int(manifest["vocab_size"]), note,
                      [str(path / s["file"]) for s in shards], blocks)
    if source.endswith(".bin"):
        segments, note = _limit([map_ids(path, np.uint16, scattered=True)], max_bytes, source)
        return Corpus(segments, None, 1 << 16, note, [source])
    if source == "stdlib":
        files, sizes = map(list, _stdlib())
    else:
        files = files_of(path)
        sizes = [f.stat().st_size for f in files]
    sizes = np.cumsum(sizes)
    if max_bytes:  # map only the files the limit reaches
        files = files[: int(np.searchsorted(sizes, max_bytes)) + 1]
    segments = [map_ids(f, np.uint8) for f in files if f.stat().st_size]
    segments, note = _limit(segments, max_bytes, source, total=int(sizes[-1]) if files else 0)
    starts = np.cumsum([0] + [len(s) for s in segments], dtype=np.int64)
    return Corpus(segments, starts, 256, note)
