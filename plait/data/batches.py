"""Token data by epochs: windows of a memory-mapped corpus (`corpus.py`), each training window
visited once per epoch, and global batches that depend only on the seed and the step, never on the
number of ranks.

The training split is cut into windows of seq_len + 1 ids that overlap by one (the last target of
one is the first input of the next). Step s's global batch is positions s*B .. s*B + B - 1 of the
endless sequence "epoch 0's order, epoch 1's order, ...", where each epoch's order is a permutation
of the windows chosen by (seed, epoch). Each data-parallel rank reads only its own contiguous slice
of the rows, so the union of the ranks' slices is the 1-rank batch, row for row, at any world size
and after a resume on another one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from plait.config.schema import ConfigError, DataConfig
from plait.data.corpus import (
    CorpusError,
    is_prepared,
    map_ids,
    open_corpus,
    read_manifest,
    sample_ids,
    verify_shards,
)

if TYPE_CHECKING:
    import torch

_MASK64 = (1 << 64) - 1


class ByteTokenizer:
    """Bytes are tokens: vocabulary 256, no merges, every text round-trips."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, tokens) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


_ODD = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, odd: Knuth's multiplicative hash
SMALL = 64  # indices at most this many: Python ints beat numpy's per-call cost


def permute(index: np.ndarray, n: int, key: int) -> np.ndarray:
    """Where each of `index` (values in [0, n)) goes under a permutation of [0, n) chosen by `key`:
    a 4-round Feistel network on the smallest even number of bits that covers n, walked until it
    lands inside [0, n) (cycle walking, Black and Rogaway 2002). Each round mixes one half into
    the other with a multiplicative hash (the top bits of a 64-bit product). O(1) memory per
    index: no permutation of the corpus's windows is ever stored. The same arithmetic runs on
    Python ints for a few indices (a step's batch) and on numpy arrays for many."""
    if n < 1:
        raise ValueError("a permutation of nothing")
    half = max(1, (int(n - 1).bit_length() + 1) // 2)
    keys = [(key * 0xD1B54A32D192ED03 + r * _ODD) & _MASK64 for r in range(1, 5)]
    if len(index) <= SMALL:
        return np.array([_walk(int(i), n, half, keys) for i in index], dtype=np.int64)
    mask, shift, drop = np.uint64((1 << half) - 1), np.uint64(half), np.uint64(64 - half)
    odd, keys = np.uint64(_ODD), [np.uint64(k) for k in keys]

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for k in keys:  # uint64 arrays wrap at 2^64, as the Python ints are masked to
            left, right = right, left ^ (((right ^ k) * odd) >> drop)
        return (left << shift) | right

    x = encrypt(np.asarray(index, dtype=np.uint64))
    while (outside := x >= np.uint64(n)).any():
        x[outside] = encrypt(x[outside])
    return x.astype(np.int64)


def _walk(x: int, n: int, half: int, keys: list[int]) -> int:
    mask, drop = (1 << half) - 1, 64 - half
    while True:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ ((((right ^ k) * _ODD) & _MASK64) >> drop)
        x = (left << half) | right
        if x < n:
            return x


def _key(seed: int, epoch: int) -> int:
    """Epoch e >= 0 of training; -1 is the validation split's one fixed order."""
    return (seed * 0x9E3779B97F4A7C15 + epoch + 1) & _MASK64


class TokenData:
    """The training and validation windows of `cfg.source`, with the batch sampler."""

    def __init__(self, cfg: DataConfig, seed: int, vocab_size: int | None = None):
        """`vocab_size`: the model's; ids read at or beyond it stop the run (naming where)."""
        try:
            self.corpus = open_corpus(cfg.source, cfg.max_bytes)
        except (CorpusError, OSError) as e:
            raise ConfigError("data.source", str(e)) from None
        if vocab_size is not None:
            self.corpus.vocab_size = min(self.corpus.vocab_size, vocab_size)
        self.seq_len, self.seed = cfg.seq_len, seed
        self.document_mask = cfg.document_mask
        if cfg.document_mask and self.corpus.starts is None:
            raise ConfigError("data.document_mask", f"{cfg.source} does not say where its "
                              "documents begin (a .bin is one stream of ids); prepare it with "
                              "plait data prepare, or set data.document_mask = false")
        self.split = self.corpus.split(cfg.val_fraction)
        self.train_windows = (self.split - 1) // self.seq_len
        self.val_windows = (self.corpus.tokens - self.split - 1) // self.seq_len
        if self.train_windows < 1 or self.val_windows < 1:
            raise ConfigError(
                "data.source", f"{self.corpus.tokens} tokens is too little for seq_len="
                f"{cfg.seq_len} and a validation split of {cfg.val_fraction}; use more text")

    def _rows(self, first: int, windows: np.ndarray) -> tuple[torch.Tensor, ...]:
        """(inputs, targets), and under `data.document_mask` the inputs' documents."""
        rows = as_rows(self.read(first, windows))
        return (*rows, self.documents(first, windows)) if self.document_mask else rows

    def documents(self, first: int, windows: np.ndarray) -> torch.Tensor:
        """(len(windows), seq_len): each input token's document, numbered from 0 in its window
        (its first token's), from the corpus's document starts."""
        # here, not at the top: the checks before launch import no torch (tests/unit/test_config.py)
        import torch

        at = self.window_starts(first, windows)[:, None] + np.arange(self.seq_len)
        doc = np.searchsorted(self.corpus.starts, at, side="right")
        return torch.from_numpy(doc - doc[:, :1])

    def read(self, first: int, windows: np.ndarray) -> np.ndarray:
        """The windows' ids, (len(windows), seq_len + 1); `first`: 0 (training) or `split`."""
        return self.corpus.read(self.window_starts(first, windows), self.seq_len + 1)

    def window_starts(self, first: int, windows: np.ndarray) -> np.ndarray:
        """Where in the corpus's stream each of `windows` begins (`first`: its split's start)."""
        return first + windows * self.seq_len

    def metrics(self, steps: int, global_batch: int) -> dict:
        return {"epoch": self.epochs(steps, global_batch)}  # windows visited / all

    def validation_sets(self) -> list[tuple[str, TokenData]]:
        """What validation reports on, by the suffix of its metric: the split alone."""
        return [("", self)]

    def windows_at(self, visit: np.ndarray) -> np.ndarray:
        """The training windows at these positions of the endless sequence of epochs."""
        epoch, index = np.divmod(visit, self.train_windows)
        if epoch[0] == epoch[-1]:  # the usual case: one epoch
            return permute(index, self.train_windows, _key(self.seed, int(epoch[0])))
        out = np.empty_like(visit)
        for e in np.unique(epoch).tolist():  # a batch may straddle two epochs
            out[epoch == e] = permute(index[epoch == e], self.train_windows, _key(self.seed, e))
        return out

    def windows(self, step: int, global_batch: int) -> np.ndarray:
        """The training windows of `step`'s global batch, in row order."""
        return self.windows_at(positions(step, global_batch))

    def epochs(self, steps: int, global_batch: int) -> float:
        """Epochs completed after `steps` steps: windows visited / windows in the training split."""
        return steps * global_batch / self.train_windows

    def batch(self, step: int, global_batch: int, rank: int = 0, ranks: int = 1,
              microbatches: int = 1):
        """This rank's rows of the global training batch of `step`: (inputs, targets), each
        (global_batch / ranks, seq). With micro-batches, the global batch is cut into that many
        runs of rows and the rank takes its share of each, in order: micro-batch m over all
        ranks is the global batch's m-th run (what a mixture of experts routes together). Only
        this rank's rows are drawn and read."""
        visit = positions(step, global_batch)
        return self._rows(0, self.windows_at(share(visit, rank, ranks, microbatches)))

    def val_batch(self, index: int, global_batch: int, rank: int = 0, ranks: int = 1,
                  microbatches: int = 1):
        """A fixed validation batch (same rows for every run with this data and seed); a split of
        fewer windows than the batch repeats them."""
        visit = share(positions(index, global_batch), rank, ranks, microbatches)
        return self._rows(self.split, self.val_windows_at(visit))

    def val_windows_at(self, visit: np.ndarray) -> np.ndarray:
        """The validation windows at these positions: one fixed order, repeated."""
        return permute(visit % self.val_windows, self.val_windows, _key(self.seed, -1))


def as_rows(windows: np.ndarray) -> tuple[torch.Tensor, ...]:
    """Windows of seq_len + 1 ids as (inputs, targets), each (rows, seq_len)."""
    # here, not at the top: the checks before launch import no torch (tests/unit/test_config.py)
    import torch  # here: `check_source` refuses a bad corpus before torch is imported

    window = torch.from_numpy(windows)
    return window[:, :-1], window[:, 1:]


def positions(index: int, global_batch: int) -> np.ndarray:
    """Batch `index`'s places in the endless sequence of windows: B index ... B index + B - 1."""
    return index * global_batch + np.arange(global_batch, dtype=np.int64)


def share(rows: np.ndarray, rank: int, ranks: int, microbatches: int) -> np.ndarray:
    return rows.reshape(microbatches, ranks, -1)[:, rank].reshape(-1)


def check_source(cfg: DataConfig, vocab_size: int, global_batch: int,
                 vocab_key: str = "model.vocab_size") -> str:
    """Before any worker starts, in time independent of the corpus's size: the source reads (a
    prepared folder's manifest, each shard present, of its size, and a sample of its ids below
    the vocabulary; a `.bin` whole ids and a sample of them below the model's vocabulary, which
    `vocab_key` names), and its training split holds one global batch of windows. A prepared
    folder's sampled blocks are checked against their crc32s; training checks each block it
    reads, and every id's range (`corpus.py`); the whole corpus is `plait data verify`'s. Returns
    the notes a limit the user asked for, or a corpus without block checksums, makes ("" when
    none); raises ConfigError naming the key. A mixture (`data.sources`): `mixture.check_corpus`."""
    unchecked = ""
    try:
        if is_prepared(cfg.source):
            manifest = read_manifest(Path(cfg.source))
            if manifest["vocab_size"] > vocab_size:
                raise ConfigError(vocab_key, f"the tokenizer of {cfg.source} has "
                                  f"{manifest['vocab_size']} tokens, the model {vocab_size}; "
                                  + vocab_fix(vocab_key, manifest["vocab_size"]))
            unchecked = verify_shards(Path(cfg.source), manifest)
        elif cfg.source.endswith(".bin"):
            _check_bin(Path(cfg.source), vocab_size, vocab_key)
        data = TokenData(cfg, seed=0)
    except CorpusError as e:
        raise ConfigError(e.key, e.message) from None
    except OSError as e:
        raise ConfigError("data.source", f"cannot read {cfg.source}: {e.strerror or e}") from None
    if data.corpus.vocab_size <= 256 and vocab_size < data.corpus.vocab_size:
        raise ConfigError(vocab_key, f"byte-level text has 256 token ids, the model "
                          f"{vocab_size}; " + vocab_fix(vocab_key, 256))
    if data.train_windows < global_batch:
        raise ConfigError("data.source", f"the training split holds {data.train_windows} windows "
                          f"of seq_len + 1 = {cfg.seq_len + 1} tokens, fewer than one global batch "
                          f"(train.global_batch = {global_batch}); use more text, a shorter "
                          "data.seq_len or a smaller batch")
    return "\n".join(note for note in (unchecked, data.corpus.note) if note)


def _check_bin(path: Path, vocab_size: int, vocab_key: str) -> None:
    """A uint16 `.bin`: whole ids, a sample of them (64 blocks) below the vocabulary."""
    size = path.stat().st_size
    if size % 2 or not size:
        raise ConfigError("data.source", f"{path} has {size} bytes, not a whole number of uint16 "
                          "token ids (2 bytes each): cut, or not ids?")
    try:
        sample_ids(map_ids(path, np.uint16, scattered=True), vocab_size, str(path), vocab_key,
                   blocks=64)
    except CorpusError as e:
        raise ConfigError(vocab_key, f"{e.message}; {vocab_fix(vocab_key)} or fix the "
                          "data") from None


def vocab_fix(vocab_key: str, need: int = 0) -> str:
    """How a user makes room for a corpus's token ids: a number to raise, or, where the key is a
    `model.hf` folder (whose vocabulary is its own, not a number), the model's own tokenizer."""
    if vocab_key.startswith("model.hf"):
        return "prepare the corpus with the model's own tokenizer"
    return f"set {vocab_key} >= {need}" if need else f"raise {vocab_key}"
