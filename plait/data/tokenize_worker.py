"""A `plait data prepare` worker: encodes chunks of documents with the tokenizer it was started
with, on one thread (`--workers` says how many cores tokenize). Imports numpy and tokenizers only,
so a worker starts in a fraction of a second."""

from __future__ import annotations

import os

import numpy as np

_TOKENIZER: list = []  # this worker's, set once by `start` (empty: bytes)


def start(tokenizer_json: str | None) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # encode_batch on this worker's thread alone
    if tokenizer_json is not None:
        # here, not at the top: tokenizers only for a tokenizer that needs them
        from tokenizers import Tokenizer

        _TOKENIZER.append(Tokenizer.from_str(tokenizer_json))


def encode(docs: list[str | bytes], eot: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Ids of the documents, each followed by `eot`: (ids as uint32, each document's length).
    Without a tokenizer a document's UTF-8 bytes are its ids."""
    if not _TOKENIZER:
        pieces = [np.frombuffer(d if isinstance(d, bytes) else d.encode(), np.uint8) for d in docs]
    else:
        pieces = [np.append(np.asarray(e.ids, np.uint32), np.uint32(eot))
                  for e in _TOKENIZER[0].encode_batch(docs)]
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    ids = np.concatenate(pieces).astype(np.uint32) if pieces else np.zeros(0, np.uint32)
    return ids, lengths
