"""`plait bench data`: what a prepared corpus costs. Tokenization throughput of `plait data
prepare` (tokens/s per worker, a byte-level BPE trained on the text), then training on corpora of
two sizes: each rank's own memory (anonymous resident memory, RssAnon: what a rank holding the
corpus would grow; the memory-mapped shards are page cache, shared and reclaimable) and the time
a step waits for its rows, against torch's own recipe for the same windows (a map-style Dataset
over the same memory map, `DistributedSampler(shuffle=True)` with `set_epoch`, `DataLoader`),
whose per-epoch permutation is held in full by every rank.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from plait.bench.step import start_worker
from plait.config import Config
from plait.train.corpus import stdlib_files
from plait.train.data import TokenData
from plait.train.host_memory import anonymous_bytes
from plait.train.prepare import prepare
from plait.train.trainer import Trainer


def stdlib_text(max_bytes: int) -> list[str]:
    """The first .py files of Python's standard library that add up to about `max_bytes`."""
    files, total = [], 0
    for f in stdlib_files():
        if total < max_bytes:
            files.append(str(f))
            total += f.stat().st_size
    return files


def tokenize(out: Path, text_bytes: int, vocab: int, workers: list[int]) -> list[dict]:
    """`prepare` on the text with a BPE of `vocab` tokens trained on it, at each worker count;
    the first run's folder (out/w{first}) is the corpus."""
    sources, rows, tokenizer = stdlib_text(text_bytes), [], f"bpe:{vocab}"
    for n in workers:
        done = prepare(sources, str(out / f"w{n}"), tokenizer, workers=n, progress=False)
        tokenizer = str(out / f"w{workers[0]}" / "tokenizer.json")  # trained once
        rows.append({"workers": n, "documents": done["documents"], "tokens": done["tokens"],
                     "text_bytes": sum(Path(s).stat().st_size for s in sources),
                     "tokens_per_s": done["tokens_per_s"]})
    return rows


def big_corpus(out: Path, id_bytes: int, workers: int) -> dict:
    """A corpus of about `id_bytes` bytes of ids: the standard library's .py files, repeated, as
    bytes (ids below 256, uint16), which tokenizes fast enough to make a gigabyte."""
    sources = stdlib_text(1 << 40)
    size = sum(Path(s).stat().st_size for s in sources)
    repeats = max(1, round(id_bytes / 2 / size))
    return prepare(sources * repeats, str(out), "bytes", workers=workers, progress=False)


class Windows(Dataset):
    """torch's recipe: the same training windows, one per index, read from the same memory map."""

    def __init__(self, data: TokenData):
        self.data = data

    def __len__(self) -> int:
        return self.data.train_windows

    def __getitem__(self, i: int) -> torch.Tensor:
        seq = self.data.seq_len
        return torch.from_numpy(self.data.corpus.read(np.array([i * seq]), seq + 1)[0])


@record
def bench_data(cfg: Config, steps: int) -> list[dict] | None:
    dims, mesh = start_worker(cfg)
    rank, n, batch = dist.get_rank(), dims.dp, cfg.train.global_batch
    trainer = Trainer(cfg, dims, mesh, torch.device("cpu"))
    times, waits = [], []
    for step in range(steps):
        start = time.perf_counter()
        result = trainer.train_step(step)
        times.append(time.perf_counter() - start)
        waits.append(result["data_wait_s"])
    plait_anon = anonymous_bytes()
    # torch's recipe on the same windows: a new epoch's iterator draws and holds a permutation
    # of every window (DistributedSampler.__iter__), then each batch reads its rows.
    sampler = DistributedSampler(Windows(trainer.data), n, rank, shuffle=True,
                                 seed=cfg.train.seed)
    loader = DataLoader(Windows(trainer.data), batch_size=batch // n, sampler=sampler)
    sampler.set_epoch(1)
    start = time.perf_counter()
    rows = iter(loader)
    next(rows)  # the epoch's permutation is drawn here, with the first batch
    epoch_start = time.perf_counter() - start
    torch_waits = []
    for _ in range(steps):
        start = time.perf_counter()
        next(rows)
        torch_waits.append(time.perf_counter() - start)
    row = {"rank": rank, "anon": plait_anon, "torch_anon": anonymous_bytes(),
           "step_s": statistics.median(times[1:]), "wait_s": statistics.median(waits[1:]),
           "torch_wait_s": statistics.median(torch_waits), "torch_epoch_start_s": epoch_start,
           "tokens": trainer.data.corpus.tokens, "windows": trainer.data.train_windows}
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, row)
    dist.destroy_process_group()
    return out if rank == 0 else None


def run_data(cfg: Config, nproc: int, sizes_mb: list[int], workers: list[int], steps: int,
             folder: Path) -> dict:
    """The whole bench (module docstring); prints two tables, returns their rows."""
    import dataclasses  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    from plait.checks import validate  # noqa: PLC0415
    from plait.launch import launch  # noqa: PLC0415

    validate(cfg, nproc)
    shutil.rmtree(folder, ignore_errors=True)
    vocab = cfg.model.args().vocab_size
    tok_rows = tokenize(folder / "text", sizes_mb[0] << 20, vocab, workers)
    table = Table(title=f"plait bench data: tokenizing {tok_rows[0]['text_bytes'] / 1e6:.1f} MB "
                  f"of text with a byte-level BPE of {vocab} tokens (plait data prepare)")
    for col in ("workers", "documents", "tokens", "tokens/s", "tokens/s per worker"):
        table.add_column(col, justify="right")
    for r in tok_rows:
        table.add_row(str(r["workers"]), f"{r['documents']:,}", f"{r['tokens']:,}",
                      f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / r['workers']:,.0f}")
    Console(width=150).print(table)
    corpora = [(folder / "text" / f"w{workers[0]}", "BPE")]
    for mb in sizes_mb[1:]:
        big_corpus(folder / f"{mb}mb", mb << 20, max(workers))
        corpora.append((folder / f"{mb}mb", "bytes"))
    train_rows = []
    for path, kind in corpora:
        run = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=str(path)))
        rows = launch(nproc, bench_data, run, steps, threads=cfg.train.threads)[0]
        worst = max(rows, key=lambda r: r["anon"])
        ids = sum(f.stat().st_size for f in path.glob("shard-*.bin"))
        train_rows.append({"corpus": str(path), "kind": kind, "id_bytes": ids, **worst,
                           "wait_share": statistics.median(r["wait_s"] / r["step_s"]
                                                           for r in rows)})
    table = Table(title=f"training on {nproc} ranks ({cfg.model.preset} model, vocabulary "
                  f"{vocab}, {cfg.train.global_batch} x {cfg.data.seq_len} tokens a step, "
                  f"{steps} steps): the rank with most memory; torch: DistributedSampler + "
                  "DataLoader on the same memory map")
    for col in ("corpus", "ids on disk", "windows", "RssAnon", "torch RssAnon", "step",
                "data wait", "share", "torch wait", "plait / torch", "torch epoch start"):
        table.add_column(col, justify="left" if col == "corpus" else "right")
    for r in train_rows:
        table.add_row(f"{r['tokens'] / 1e6:,.0f}M ids ({r['kind']})", _mb(r["id_bytes"]),
                      f"{r['windows']:,}", _mb(r["anon"]), _mb(r["torch_anon"]),
                      f"{r['step_s'] * 1e3:.1f} ms", f"{r['wait_s'] * 1e3:.2f} ms",
                      f"{r['wait_share']:.1%}", f"{r['torch_wait_s'] * 1e3:.2f} ms",
                      f"{r['wait_s'] / r['torch_wait_s']:.2f}",
                      f"{r['torch_epoch_start_s'] * 1e3:.0f} ms")
    Console(width=170).print(table)
    shutil.rmtree(folder, ignore_errors=True)
    return {"tokenize": tok_rows, "train": train_rows}


def _mb(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"
