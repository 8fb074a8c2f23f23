"""`plait data prepare SRC... OUT --tokenizer T`: documents to token ids, written once so that
training reads them through memory maps (`corpus.py`), as Megatron's indexed datasets and
nanoGPT's prepare scripts do.

Documents: a text file is one; a row of a JSONL / Parquet / Arrow file is one (its `--field`), read
by Hugging Face `datasets` as a stream (no cache copy of the corpus). The tokenizer: a
`tokenizer.json` (Hugging Face `tokenizers`), a model folder holding one, `bpe:N` (a byte-level BPE
of N tokens trained on SRC), or `bytes` (each byte a token, no end-of-text token). Each document's
ids are followed by the end-of-text token. Ids go into shards of uint16 (vocabulary <= 65,536) or
uint32, with `manifest.json` (vocab_size, dtype, documents, tokens, eot, shards with sizes and
sha256), `documents.npy` (each document's first position, then the total), `checksums.npy` (the
crc32 of each 64 KiB block of each shard: what a launch samples and training checks as it reads)
and `tokenizer.json`.
The manifest is written last: a folder without one is not a corpus.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import time
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from plait.config.paths import creatable
from plait.config.schema import ConfigError
from plait.data import tokenize_worker
from plait.data.corpus import BLOCK_BYTES, CHECKSUMS, INDEX, MANIFEST, SHARD_TOKENS, files_of

TABLES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
CHUNK_BYTES = 1 << 20  # text per task sent to a worker


@dataclass
class TokenizerSpec:
    """What prepare needs of a tokenizer: its serialized form (None for bytes), the end-of-text
    id (None for bytes) and the vocabulary size."""

    json: str | None
    eot: int | None
    vocab_size: int


def documents(sources: list[str], field: str, skipped: list[str] | None = None
              ) -> Iterator[str | bytes]:
    """Every document of the sources, in order: table rows' `field`; text files whole, as bytes,
    or as text when `skipped` is a list, which then collects the files that are not UTF-8
    (a picture in a folder of text) instead of yielding them."""
    for source in sources:
        for f in files_of(Path(source)):
            if f.suffix in TABLES:
                yield from _rows(f, field)
            elif f.stat().st_size and skipped is None:
                yield f.read_bytes()
            elif f.stat().st_size:
                try:
                    yield f.read_bytes().decode("utf-8")
                except UnicodeDecodeError:
                    skipped.append(str(f))


def _rows(path: Path, field: str) -> Iterator[str]:
    # here, not at the top: datasets only for tables (JSON lines, Parquet, Arrow)
    import datasets  # noqa: PLC0415 (seconds to import; only tables need it)

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors are said here, once
    # A streaming dataset imports torch when it is installed, to share its epoch counter with a
    # DataLoader's workers and to subclass torch's IterableDataset; plait reads the rows as
    # dicts, so it asks for neither (importing torch was most of a bad table's refusal: seconds).
    # Only while plait reads: a Python caller's own datasets keep torch.
    torch_available, datasets.config.TORCH_AVAILABLE = datasets.config.TORCH_AVAILABLE, False
    try:
        try:  # it reads the first rows already, for their columns
            rows = datasets.load_dataset(TABLES[path.suffix], data_files=str(path),
                                         split="train", streaming=True)
        except Exception as e:  # noqa: BLE001 -- as `_readable`'s
            raise _unreadable(path, e, 0) from None
        for i, row in _readable(rows, path):
            if field not in row:
                raise _no_field(path, field, row)
            if not isinstance(row[field], str):
                raise ConfigError("--field", f"row {i} of {path}: '{field}' is "
                                  f"{type(row[field]).__name__}, not text")
            yield row[field]
    finally:
        datasets.config.TORCH_AVAILABLE = torch_available


def _readable(rows, path: Path) -> Iterator[tuple[int, dict]]:
    """The table's rows, numbered; a table that does not parse stops prepare in one line."""
    it, i = iter(rows), 0
    while True:
        try:
            row = next(it)
        except StopIteration:
            return
        except Exception as e:  # datasets raises its readers' errors, of many classes
            raise _unreadable(path, e, i) from None
        yield i, row
        i += 1


def _unreadable(path: Path, e: Exception, read: int) -> ConfigError:
    """One line for a table datasets could not read, after `read` rows: pyarrow's error where
    it is in the chain (datasets falls back to pandas' JSON parser, whose error says less:
    "Expected object or value"), else the first cause."""
    chain, cause, seen = [e], e.__cause__ or e, set()
    while chain:
        x = chain.pop(0)
        if type(x).__module__.startswith("pyarrow"):
            cause = x
            break
        seen.add(id(x))
        chain += [c for c in (x.__cause__, x.__context__) if c is not None and id(c) not in seen]
    cause = str(cause).splitlines()[0][:160]
    after = f" (plait had read {read} row(s) before it)" if read else ""
    return ConfigError("SRC", f"{path} does not read as {TABLES[path.suffix]}: {cause}{after}")


def _first_json_line(path: Path, field: str) -> None:
    """A JSON-lines table's first row read with `json` alone: a field it lacks, or a first line
    that is not JSON, is refused without importing `datasets` (seconds), which reads the rest."""
    if path.suffix != ".jsonl":
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        line = next((line for line in f if line.strip()), None)
    if line is None:
        return
    try:
        row = json.loads(line)
    except ValueError as e:
        raise ConfigError("SRC", f"{path} does not read as json: its first line is not JSON "
                          f"({e})") from None
    if isinstance(row, dict) and field not in row:
        raise _no_field(path, field, row)


def _no_field(path: Path, field: str, row: dict) -> ConfigError:
    return ConfigError("--field", f"{path} has no field '{field}' (it has {', '.join(row)}); "
                       "name the text's field with --field")


def resolve_tokenizer(spec: str, sources: list[str], field: str) -> TokenizerSpec:
    """`spec` as a TokenizerSpec; `bpe:N` trains one on the sources (tokenizers' BPE trainer)."""
    # here, not at the top: tokenizers only for a tokenizer that needs them
    from tokenizers import Tokenizer as HfTokenizer  # noqa: PLC0415

    if spec == "bytes":
        return TokenizerSpec(None, None, 256)
    if spec.startswith("bpe:"):
        tok = _train_bpe(spec, sources, field)
    else:
        path = Path(spec)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError("--tokenizer", f"no {file}; give a tokenizer.json, a Hugging Face "
                              "model folder holding one, bpe:N or bytes")
        try:
            tok = HfTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises its own Exception for any unreadable file
            raise ConfigError("--tokenizer", f"{file} is not a tokenizer "
                              f"({str(e).splitlines()[0][:120]}); give a tokenizer.json, "
                              "bpe:N or bytes") from None
    eot = _end_of_text(tok, Path(spec))
    return TokenizerSpec(tok.to_str(), eot, tok.get_vocab_size(with_added_tokens=True))


def _train_bpe(spec: str, sources: list[str], field: str):
    # here, not at the top: tokenizers only for a tokenizer that needs them
    from tokenizers import Tokenizer as HfTokenizer  # noqa: PLC0415
    from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    try:
        size = int(spec[4:])
    except ValueError:
        size = 0
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if size <= len(alphabet):
        raise ConfigError("--tokenizer", f"{spec}: a byte-level BPE needs more than "
                          f"{len(alphabet)} tokens (its bytes and end-of-text), e.g. bpe:8192")
    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=[EOT_NAMES[0]],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(documents(sources, field, skipped=[]), trainer)
    return tok


def _end_of_text(tok, folder: Path) -> int:
    """The end-of-text id: the model folder's `eos_token`, else a token of a well-known name."""
    config = folder / "tokenizer_config.json"
    names = list(EOT_NAMES)
    if folder.is_dir() and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        names.insert(0, eos.get("content") if isinstance(eos, dict) else eos)
    for name in names:
        if name and (eot := tok.token_to_id(name)) is not None:
            return eot
    raise ConfigError("--tokenizer", f"the tokenizer has none of the end-of-text tokens "
                      f"{', '.join(EOT_NAMES)}; documents need a separator")


def _pool(workers: int, tokenizer_json: str | None):
    """Worker processes forked from a fresh single-threaded server (`forkserver`), not from this
    process, whose threads (tokenizers' after training a BPE, torch's, a test's) may hold locks
    at the fork: forked from here, a worker hung once, in the test suite."""
    return multiprocessing.get_context("forkserver").Pool(workers, tokenize_worker.start,
                                                          (tokenizer_json,))


def _chunks(docs: Iterator[str | bytes]) -> Iterator[list]:
    chunk, size = [], 0
    for d in docs:
        chunk.append(d)
        size += len(d)
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class _ShardWriter:
    """Appends ids to shard files of at most `shard_tokens` ids, hashing as it writes: each
    shard's sha256, and the crc32 of each of its `block_bytes` blocks (`sums`, shard by shard)."""

    def __init__(self, out: Path, dtype, shard_tokens: int, block_bytes: int):
        self.out, self.dtype, self.limit = out, dtype, shard_tokens
        self.shards: list[dict] = []
        self.file = None
        self.block, self.sums, self.crc, self.filled = block_bytes, [], 0, 0

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype)
        while len(ids):
            if self.file is None or self.shards[-1]["tokens"] == self.limit:
                self._open()
            room = self.limit - self.shards[-1]["tokens"]
            piece, ids = ids[:room], ids[room:]
            data = piece.tobytes()
            self.file.write(data)
            self.hash.update(data)
            self._blocks(memoryview(data))
            self.shards[-1]["tokens"] += len(piece)
            self.shards[-1]["bytes"] += piece.nbytes

    def _open(self) -> None:
        self.close()
        name = f"shard-{len(self.shards):05d}.bin"
        self.file, self.hash = open(self.out / name, "wb"), hashlib.sha256()  # noqa: SIM115
        self.shards.append({"file": name, "tokens": 0, "bytes": 0})

    def _blocks(self, data: memoryview) -> None:
        while len(data):
            take = min(self.block - self.filled, len(data))
            self.crc, self.filled = zlib.crc32(data[:take], self.crc), self.filled + take
            data = data[take:]
            if self.filled == self.block:
                self.sums.append(self.crc)
                self.crc, self.filled = 0, 0

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.shards[-1]["sha256"] = self.hash.hexdigest()
            self.file = None
            if self.filled:  # the shard's last block, shorter
                self.sums.append(self.crc)
                self.crc, self.filled = 0, 0


def prepare(sources: list[str], out: str, tokenizer: str, field: str = "text", workers: int = 1,
            shard_tokens: int = SHARD_TOKENS, progress: bool = True,
            follow_links: bool = False) -> dict:
    """Tokenize the sources into `out` (see the module's docstring); returns the manifest, with
    `seconds` and `tokens_per_s` of the tokenization."""
    check_prepare(sources, out, workers, shard_tokens, follow_links)
    folder, existed = Path(out), Path(out).exists()
    try:
        return _prepare(sources, folder, tokenizer, field, workers, shard_tokens, progress)
    except BaseException:
        if not existed:  # a folder without its manifest is no corpus: leave nothing half-made
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _prepare(sources: list[str], folder: Path, tokenizer: str, field: str, workers: int,
             shard_tokens: int, progress: bool) -> dict:
    files = [f for s in sources for f in files_of(Path(s))]
    tables = [f for f in files if f.suffix in TABLES]
    if tables:  # its format and --field, before any worker or progress (later rows as read)
        _first_json_line(tables[0], field)
        next(_rows(tables[0], field), None)
    tok = resolve_tokenizer(tokenizer, sources, field)
    folder.mkdir(parents=True, exist_ok=True)
    if tok.json is not None:
        (folder / "tokenizer.json").write_text(tok.json)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    writer, lengths = _ShardWriter(folder, dtype, shard_tokens, BLOCK_BYTES), []
    total = None if tables else sum(f.stat().st_size for f in files)
    with _pool(workers, tok.json) as pool, _Bar(total, progress) as bar:
        pool.starmap(tokenize_worker.encode, [([], None)] * workers)  # started: time from here
        start = bar.start = time.perf_counter()
        pending: deque = deque()
        skipped = None if tok.json is None else []  # bytes: every file is a document
        for chunk in _chunks(documents(sources, field, skipped)):  # <= 2 tasks a worker in flight
            task = pool.apply_async(tokenize_worker.encode, (chunk, tok.eot))
            pending.append((task, _bytes(chunk)))
            while len(pending) > 2 * workers or (pending and pending[0][0].ready()):
                _take(pending, writer, lengths, bar)
        while pending:
            _take(pending, writer, lengths, bar)
        if not lengths:  # said in place of the bar
            raise ConfigError("SRC", f"no documents in {', '.join(sources)}"
                              + (f" ({len(skipped)} file(s) not UTF-8 text)" if skipped else ""))
    writer.close()
    seconds = time.perf_counter() - start
    lengths = np.concatenate(lengths)
    np.save(folder / INDEX, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    np.save(folder / CHECKSUMS, np.array(writer.sums, dtype=np.uint32))
    manifest = {"format": "plait-tokens/1", "vocab_size": tok.vocab_size,
                "dtype": np.dtype(dtype).name, "documents": len(lengths),
                "tokens": int(lengths.sum()), "eot": tok.eot,
                "tokenizer": "tokenizer.json" if tok.json is not None else tokenizer,
                "sources": [str(s) for s in sources], "skipped": skipped or [],
                "block_bytes": writer.block, "checksums": CHECKSUMS, "shards": writer.shards}
    (folder / (MANIFEST + ".tmp")).write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(folder / (MANIFEST + ".tmp"), folder / MANIFEST)  # last: the folder is now whole
    return {**manifest, "seconds": seconds, "tokens_per_s": manifest["tokens"] / seconds}


def _bytes(chunk: list) -> int:
    return sum(len(d) for d in chunk)


def _take(pending: deque, writer: _ShardWriter, lengths: list, bar) -> None:
    task, size = pending.popleft()
    ids, doc_lengths = task.get()
    writer.write(ids)
    lengths.append(doc_lengths)
    bar.advance(size, len(ids))


class _Bar:
    """rich's progress bar over the sources' bytes, with tokens/s (nothing when disabled)."""

    def __init__(self, total: int | None, enabled: bool):  # None: tables, whose size is not text
        self.enabled, self.total, self.tokens, self.start = enabled, total, 0, time.perf_counter()

    def __enter__(self):
        if self.enabled:

            self.bar = Progress(TextColumn("tokenizing"), BarColumn(),
                                TextColumn("{task.percentage:>3.0f}%  {task.fields[rate]}"),
                                TimeRemainingColumn())
            self.bar.start()
            self.task = self.bar.add_task("", total=self.total, rate="")
        return self

    def advance(self, size: int, tokens: int) -> None:
        self.tokens += tokens
        if self.enabled:
            rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
            self.bar.update(self.task, advance=size, rate=f"{rate:,.0f} tokens/s")

    def __exit__(self, *exc):
        if self.enabled:
            if exc[0] is None:  # skipped files' bytes were never advanced
                self.bar.update(self.task, completed=self.total)
            else:  # a refusal found while reading (a table's bad row) is the one line shown:
                # the bar is erased (a terminal) or never printed (output to a file or pipe)
                self.bar.live.transient = True
                self.bar.live.console.quiet = not self.bar.live.console.is_terminal
            self.bar.stop()


def check_prepare(sources: list[str], out: str, workers: int, shard_tokens: int,
                  follow_links: bool = False) -> None:
    """One line naming the argument, before any work: sources readable, no link in a source
    folder leading out of it (unless `follow_links`), OUT new or empty, writable, not inside a
    source."""
    if not sources:
        raise ConfigError("SRC", "name at least one text file, folder or table to prepare")
    for s in sources:
        if not Path(s).exists():
            raise ConfigError("SRC", f"no such file or folder '{s}'")
    if workers < 1:
        raise ConfigError("--workers", f"at least 1, got {workers}")
    if shard_tokens < 1:
        raise ConfigError("--shard-tokens", f"at least 1, got {shard_tokens}")
    folder = Path(out)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError("OUT", f"{out} exists and is not an empty folder; choose a new one")
    target = folder.resolve()
    for s in sources:
        root = Path(s).resolve()
        if root.is_dir() and target.is_relative_to(root):
            raise ConfigError("OUT", f"{out} is inside the source {s}, whose files it would "
                              "read back as documents; write it elsewhere")
        for f in files_of(Path(s)) if root.is_dir() else ():
            if f.is_symlink() and not f.resolve().is_relative_to(root) and not follow_links:
                raise ConfigError("SRC", f"{f} links to {f.resolve()}, outside {s}: copy it "
                                  "in, or pass --follow-links to read what links point to")
    parent = next(p for p in (target, *target.parents) if p.exists())
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError("OUT", f"cannot write in {parent}; choose a folder you can write")
    problem = None if target.exists() else creatable(target, parent, folder=True)
    if problem:
        raise ConfigError("OUT", f"{out} cannot be created ({problem}); choose another folder")
