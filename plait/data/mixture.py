"""A weighted mixture of prepared corpora (`data.sources`): each row of each global batch is
drawn from one source, in proportion to the weights, as a function of (seed, its place in the
endless sequence of rows) alone; so the same batches at any number of ranks, and after a resume.

Which source a row comes from: rows are dealt by a fixed table of `PERIOD` slots, repeated. Slot
i goes to the source whose share of [0, 1) holds frac(offset + i x g), g = (sqrt 5 - 1) / 2 (the
golden-ratio sequence: any run of n consecutive slots holds each source's share to within
O(log n) rows, Weyl and Kesten), the offset drawn from the seed. Each source then reads its own
rows in its own order, by epochs (`TokenData`): the n-th row a source gives is the n-th of its
endless sequence of epochs, so each source's windows are visited once per epoch of its own, and a
small source repeats sooner than a big one (its epochs are counted apart: `epoch/<name>`).

A mixture may change when a run resumes (other weights from the step it resumes at, said once):
the rows before that step keep the weights that drew them (the checkpoint records each change),
and every source continues from the rows it had given.
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from plait.checkpoint import read_meta
from plait.config.schema import ConfigError, DataConfig, folder_name
from plait.data.batches import TokenData, as_rows, check_source, positions, share
from plait.data.corpus import MANIFEST, is_prepared, read_manifest

if TYPE_CHECKING:
    import torch

PERIOD = 1 << 16  # slots of the table of sources, repeated
GOLDEN = (5**0.5 - 1) / 2


@dataclasses.dataclass(frozen=True)
class MixedSource:
    path: str
    weight: float
    name: str


def sources_of(cfg: DataConfig) -> list[MixedSource]:
    """`data.sources` as `MixedSource`s: each name given, or the folder's own."""
    return [MixedSource(s["path"], float(s["weight"]), s.get("name") or folder_name(s["path"]))
            for s in cfg.sources]


class WeightSpan:
    """Rows `first_row` ... dealt by one table of weights (a run's mixture until it changes)."""

    def __init__(self, first_row: int, weights: list[float], seed: int):
        self.first_row = first_row
        cuts = np.cumsum(weights) / sum(weights)
        offset = ((seed * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)) / 2.0**64
        u = (offset + np.arange(PERIOD, dtype=np.float64) * GOLDEN) % 1.0
        self.table = np.minimum(np.searchsorted(cuts, u, side="right"), len(weights) - 1)
        self.per_period = np.bincount(self.table, minlength=len(weights))
        # Each slot's rank among the slots of its source before it in the table.
        self.earlier = np.empty(PERIOD, dtype=np.int64)
        for k in range(len(weights)):
            mine = self.table == k
            self.earlier[mine] = np.arange(int(mine.sum()))

    def counts(self, rows: int) -> np.ndarray:
        """How many of this span's first `rows` rows each source gave."""
        periods, rest = divmod(rows, PERIOD)
        return periods * self.per_period + np.bincount(self.table[:rest],
                                                       minlength=len(self.per_period))

    def deal(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For rows of this span (their places from its first row): each one's source and its
        place among that source's rows in the span."""
        periods, slot = np.divmod(rows, PERIOD)
        source = self.table[slot]
        return source, periods * self.per_period[source] + self.earlier[slot]


class Mixture:
    """The batches of a mixture, with `TokenData`'s interface (`batch`, `val_batch`,
    `metrics`). `history`: [(first step, {name: weight})], the weights each step range was drawn
    with (the last one this run's; one entry for a run whose mixture never changed)."""

    def __init__(self, cfg: DataConfig, seed: int, vocab_size: int | None = None,
                 history: list[tuple[int, dict[str, float]]] | None = None,
                 global_batch: int = 1):
        self.sources = sources_of(cfg)
        self.names = [s.name for s in self.sources]
        self.parts = [TokenData(dataclasses.replace(cfg, source=s.path, sources=[]),
                                seed ^ zlib.crc32(s.name.encode()), vocab_size)
                      for s in self.sources]
        now = {s.name: s.weight for s in self.sources}
        history = history or [(0, now)]
        # Sources of earlier weights that this run dropped deal their rows too (to no one now),
        # after this run's: every source's count of the rows it gave stays its own.
        dropped = sorted({name for _, weights in history for name in weights} - set(now))
        self.spans = [WeightSpan(step * global_batch,
                                 [weights.get(name, 0.0) for name in [*self.names, *dropped]],
                                 seed)
                         for step, weights in history]
        self.given = [np.zeros(len(self.names) + len(dropped), dtype=np.int64)]  # before each
        for before, after in zip(self.spans, self.spans[1:], strict=False):
            rows = after.first_row - before.first_row
            self.given.append(self.given[-1] + before.counts(rows))
        self.val = WeightSpan(0, [s.weight for s in self.sources], seed ^ 0x5EED)

    def _dealt(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each global row's source and its place in that source's endless sequence."""
        source = np.empty(len(rows), dtype=np.int64)
        visit = np.empty(len(rows), dtype=np.int64)
        starts = [s.first_row for s in self.spans]
        which = np.searchsorted(starts, rows, side="right") - 1
        for j in np.unique(which).tolist():
            mine = which == j
            span = self.spans[j]
            source[mine], visit[mine] = span.deal(rows[mine] - span.first_row)
            visit[mine] += self.given[j][source[mine]]
        return source, visit

    def _gather(self, source: np.ndarray, windows_of, first_of) -> tuple[torch.Tensor, ...]:
        """Each row from its source: (inputs, targets), and their documents (`TokenData`)."""
        ids = documents = None
        for k in np.unique(source).tolist():
            mine, part = source == k, self.parts[k]
            windows = windows_of(k, mine)
            rows = part.read(first_of(k), windows)
            if ids is None:
                ids = np.empty((len(source), rows.shape[1]), dtype=rows.dtype)
                documents = np.empty((len(source), part.seq_len), dtype=np.int64)
            ids[mine] = rows
            if part.document_mask:
                documents[mine] = part.documents(first_of(k), windows).numpy()
        rows = as_rows(ids)
        if not self.parts[0].document_mask:
            return rows
        # here, not at the top: the checks before launch import no torch (tests/unit/test_config.py)
        import torch

        return (*rows, torch.from_numpy(documents))

    def batch(self, step: int, global_batch: int, rank: int = 0, ranks: int = 1,
              microbatches: int = 1):
        """This rank's rows of `step`'s global batch (as `TokenData.batch`), each from its
        source."""
        source, visit = self._dealt(share(positions(step, global_batch), rank, ranks,
                                          microbatches))
        return self._gather(source, lambda k, mine: self.parts[k].windows_at(visit[mine]),
                            lambda k: 0)

    def val_batch(self, index: int, global_batch: int, rank: int = 0, ranks: int = 1,
                  microbatches: int = 1):
        """A fixed validation batch: the sources' validation splits in the mixture's proportions
        (this run's weights)."""
        source, visit = self.val.deal(share(positions(index, global_batch), rank, ranks,
                                            microbatches))
        return self._gather(source, lambda k, mine: self.parts[k].val_windows_at(visit[mine]),
                            lambda k: self.parts[k].split)

    def validation_sets(self) -> list[tuple[str, TokenData | Mixture]]:
        """The mixture's validation (`val_loss`), then each source's own (`val_loss/<name>`)."""
        return [("", self), *((f"/{name}", part) for name, part in zip(self.names, self.parts,
                                                                        strict=True))]

    def rows_given(self, steps: int, global_batch: int) -> np.ndarray:
        """Rows each source gave in the first `steps` steps."""
        rows = steps * global_batch
        j = int(np.searchsorted([s.first_row for s in self.spans], rows, side="right")) - 1
        given = self.given[j] + self.spans[j].counts(rows - self.spans[j].first_row)
        return given[: len(self.names)]

    def metrics(self, steps: int, global_batch: int) -> dict:
        """`epoch` (windows visited / windows, over all sources), and per source its epochs
        and the tokens it gave."""
        given = self.rows_given(steps, global_batch)
        windows = [part.train_windows for part in self.parts]
        out = {"epoch": float(given.sum()) / sum(windows)}
        for name, rows, n, part in zip(self.names, given.tolist(), windows, self.parts,
                                       strict=True):
            out[f"epoch/{name}"] = rows / n
            out[f"tokens/{name}"] = rows * part.seq_len
        return out


def check_corpus(cfg: DataConfig, vocab_size: int, global_batch: int,
                 vocab_key: str = "model.vocab_size") -> str:
    """The run's corpus checked before any worker starts: its one source (`check_source`) or
    each of its mixture's (`check_sources`); the notes to say."""
    if cfg.sources:
        return check_sources(cfg, vocab_size, vocab_key)
    return check_source(cfg, vocab_size, global_batch, vocab_key)


def check_sources(cfg: DataConfig, vocab_size: int, vocab_key: str) -> str:
    """Each source as `check_source` checks a prepared folder (the errors naming the source), all
    tokenized alike (the same vocabulary, end-of-text id and tokenizer); their notes."""
    notes, first = [], None
    for i, source in enumerate(sources_of(cfg)):
        key = f"data.sources[{i}].path"
        if not is_prepared(source.path):
            raise ConfigError(key, f"{source.path} has no {MANIFEST}: give a folder that plait "
                              "data prepare wrote")
        one = dataclasses.replace(cfg, source=source.path, sources=[])
        try:
            notes.append(check_source(one, vocab_size, 1, vocab_key))
        except ConfigError as e:
            if e.field != "data.source":
                raise
            raise ConfigError(key, str(e)[len(e.field) + 2:]) from None
        tokenizer = _tokenizer(Path(source.path))
        if first is None:
            first = (tokenizer, source.path)
        elif tokenizer != first[0]:
            raise ConfigError(key, f"{source.path} was tokenized otherwise than {first[1]} "
                              "(vocabulary, end-of-text id or tokenizer.json differ); a mixture "
                              "needs one tokenizer: prepare both with the same --tokenizer")
    return "\n".join(note for note in notes if note)


def _tokenizer(folder: Path) -> tuple:
    manifest = read_manifest(folder)
    tokenizer = folder / "tokenizer.json"
    text = tokenizer.read_bytes() if tokenizer.is_file() else manifest.get("tokenizer")
    return manifest["vocab_size"], manifest.get("eot"), text


MIXTURE = "data_mixture"  # plait.json's entry: [[first step, {name: weight}], ...]


def mixture_history(cfg: DataConfig, resumed_from: Path | None) -> tuple[list, str]:
    """The weights each step range of this run was drawn with, and the sentence that says the
    mixture changed at this resume ("" if it did not). [] for a run of one source."""
    if not cfg.sources:
        return [], ""
    now = {s.name: s.weight for s in sources_of(cfg)}
    if resumed_from is None:
        return [[0, now]], ""
    saved = read_meta(resumed_from)
    history = saved.get(MIXTURE)
    if history is None:  # a checkpoint of one source, or of a model alone: the mixture starts
        return [[0, now]], ""
    if history[-1][1] == now:
        return history, ""
    before = history[-1][1]
    said = ", ".join(f"{name} {now.get(name, 0):g} (was {before.get(name, 0):g})"
                     for name in sorted(set(now) | set(before))
                     if now.get(name, 0) != before.get(name, 0))
    return [*history, [saved["step"], now]], (f"data.sources reweighed from step "
                                              f"{saved['step']}: {said}")


def open_data(cfg: DataConfig, seed: int, vocab_size: int | None = None,
              history: list | None = None, global_batch: int = 1) -> TokenData | Mixture:
    """The run's data: one source, or the mixture of `data.sources`."""
    if cfg.sources:
        return Mixture(cfg, seed, vocab_size, history, global_batch)
    return TokenData(cfg, seed, vocab_size)
