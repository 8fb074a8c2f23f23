"""Token data: a byte-level corpus (or a pre-tokenized uint16 `.bin`), a fixed validation split, and
global batches that depend only on the seed and the step, never on the number of ranks.

Each data-parallel rank draws the same global batch of row offsets and keeps its own contiguous
slice of rows, so the union of the ranks' slices is the 1-rank batch, row for row.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from plait.config import ConfigError, DataConfig


class ByteTokenizer:
    """Bytes are tokens: vocabulary 256, no merges, every text round-trips."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, tokens) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def _text_files(root: Path) -> list[Path]:
    """Files under `root` in a fixed order, skipping installed packages and caches."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        files += [Path(dirpath, f) for f in sorted(filenames)]
    return files


def read_corpus(source: str, max_bytes: int) -> np.ndarray:
    """Token ids of the source: bytes of text (uint8 ids) or a uint16 `.bin` file."""
    if source.endswith(".bin"):
        return np.fromfile(source, dtype=np.uint16, count=max_bytes // 2)
    if source == "stdlib":
        files = [f for f in _text_files(Path(sysconfig.get_paths()["stdlib"])) if f.suffix == ".py"]
    elif Path(source).is_dir():
        files = _text_files(Path(source))
    else:
        files = [Path(source)]
    chunks, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        data = f.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def check_source(cfg: DataConfig, vocab_size: int) -> int:
    """Before any worker starts: the source reads, holds whole uint16 token ids below the
    vocabulary (.bin), and enough tokens for one window of seq_len + 1 in each split. Returns the
    number of tokens; raises ConfigError naming data.source (or the model key to change)."""
    path = Path(cfg.source)
    try:
        if cfg.source.endswith(".bin"):
            size = path.stat().st_size
            if size % 2:
                raise ConfigError("data.source", f"{path} has {size} bytes, an odd number; a "
                                  "uint16 .bin holds 2 bytes per token id (cut, or not ids?)")
            tokens = np.fromfile(path, dtype=np.uint16, count=cfg.max_bytes // 2)
            if len(tokens) and int(tokens.max()) >= vocab_size:
                at = int(np.argmax(tokens >= vocab_size))
                raise ConfigError("model.vocab_size", f"token id {int(tokens[at])} at position "
                                  f"{at} of {path} is >= vocab_size={vocab_size}; raise "
                                  "model.vocab_size or fix the data")
        else:
            tokens = read_corpus(cfg.source, cfg.max_bytes)
    except OSError as e:
        raise ConfigError("data.source", f"cannot read {path}: {e.strerror or e}") from None
    n = len(tokens)
    n_val, need = int(n * cfg.val_fraction), cfg.seq_len + 2
    if n_val < need or n - n_val < need:
        raise ConfigError("data.source", f"{n} tokens is too little: the training and validation "
                          f"({cfg.val_fraction:g}) splits each need seq_len + 2 = {need}; use more "
                          "text (or data.max_bytes) or a shorter data.seq_len")
    return n


class TokenData:
    """Train and validation streams with the batch sampler."""

    def __init__(self, cfg: DataConfig, seed: int):
        tokens = torch.from_numpy(read_corpus(cfg.source, cfg.max_bytes).astype(np.int64))
        n_val = int(len(tokens) * cfg.val_fraction)
        self.seq_len, self.seed = cfg.seq_len, seed
        self.train, self.val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
        if len(self.val) <= cfg.seq_len + 1:
            raise ConfigError(
                "data.source",
                f"{len(tokens)} tokens is too little for seq_len={cfg.seq_len} and a "
                f"validation split of {cfg.val_fraction}; use more text",
            )

    def _rows(self, stream: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        idx = offsets[:, None] + torch.arange(self.seq_len + 1)  # (rows, seq + 1)
        window = stream[idx]
        return window[:, :-1], window[:, 1:]  # inputs, targets: (rows, seq)

    def _offsets(self, stream: torch.Tensor, key: int, rows: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(key)
        return torch.randint(0, len(stream) - self.seq_len - 1, (rows,), generator=g)

    def batch(self, step: int, global_batch: int, rank: int = 0, ranks: int = 1,
              microbatches: int = 1):
        """This rank's rows of the global training batch of `step`: (inputs, targets), each
        (global_batch / ranks, seq). With micro-batches, the global batch is cut into that many
        runs of rows and the rank takes its share of each, in order: micro-batch m over all
        ranks is the global batch's m-th run (what a mixture of experts routes together)."""
        offsets = self._offsets(self.train, self.seed * 1_000_003 + step, global_batch)
        return self._rows(self.train, _share(offsets, rank, ranks, microbatches))

    def val_batch(self, index: int, global_batch: int, rank: int = 0, ranks: int = 1,
                  microbatches: int = 1):
        """A fixed validation batch (same rows for every run with this data and seed)."""
        offsets = self._offsets(self.val, -1 - self.seed * 1_000_003 - index, global_batch)
        return self._rows(self.val, _share(offsets, rank, ranks, microbatches))


def _share(offsets: torch.Tensor, rank: int, ranks: int, microbatches: int) -> torch.Tensor:
    return offsets.view(microbatches, ranks, -1)[:, rank].reshape(-1)
