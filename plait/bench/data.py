"""`plait bench data`: what a prepared corpus costs. Tokenization throughput of `plait data
prepare` (tokens/s per worker, a byte-level BPE trained on the text), then training on corpora of
two sizes: each rank's own memory (anonymous resident memory, RssAnon: what a rank holding the
corpus would grow; the memory-mapped shards are page cache, shared and reclaimable) and the time
a step waits for its rows, against torch's own recipe for the same windows (a map-style Dataset
over the same memory map, `DistributedSampler(shuffle=True)` with `set_epoch`, `DataLoader`),
whose per-epoch permutation is held in full by every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from plait.bench.step import start_worker
from plait.config.schema import Config
from plait.data.batches import TokenData
from plait.data.corpus import (
    BLOCK_BYTES,
    CHECKSUMS,
    INDEX,
    MANIFEST,
    SHARD_TOKENS,
    stdlib_files,
)
from plait.data.tokenize_corpus import prepare
from plait.host_memory import (
    anonymous_bytes,
    cached_bytes,
)
from plait.launch import launch
from plait.train.checks import validate
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



def sparse_corpus(out: Path, id_bytes: int) -> dict:
    """A prepared corpus of about `id_bytes` bytes of ids (rounded up to whole checksummed blocks)
    in shards of `SHARD_TOKENS` ids, as `plait data prepare` lays them out, written as sparse
    files: every id 0, one document per shard, nothing on disk. What a launch costs on a corpus
    of that size, made in a second; its checksums are those of its zeros."""
    width = np.dtype(np.uint16).itemsize
    tokens = -(-id_bytes // BLOCK_BYTES) * BLOCK_BYTES // width
    sizes = [min(SHARD_TOKENS, tokens - at) for at in range(0, tokens, SHARD_TOKENS)]
    out.mkdir(parents=True, exist_ok=True)
    shards, digests = [], {}
    for i, n in enumerate(sizes):
        with open(out / f"shard-{i:05d}.bin", "wb") as f:
            f.truncate(n * width)
        if n not in digests:
            digests[n] = _zeros_sha256(n * width)
        shards.append({"file": f"shard-{i:05d}.bin", "tokens": n, "bytes": n * width,
                       "sha256": digests[n]})
    np.save(out / INDEX, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
    np.save(out / CHECKSUMS, np.full(tokens * width // BLOCK_BYTES,
                                     zlib.crc32(bytes(BLOCK_BYTES)), dtype=np.uint32))
    manifest = {"format": "plait-tokens/1", "vocab_size": 256, "dtype": "uint16",
                "documents": len(sizes), "tokens": tokens, "eot": None, "tokenizer": "bytes",
                "sources": ["sparse zeros"], "skipped": [], "block_bytes": BLOCK_BYTES,
                "checksums": CHECKSUMS, "shards": shards}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _zeros_sha256(size: int) -> str:
    digest, zeros = hashlib.sha256(), bytes(1 << 24)
    for at in range(0, size, len(zeros)):
        digest.update(zeros[: min(len(zeros), size - at)])
    return digest.hexdigest()

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


def run_launch(overrides: list[str], sizes_gb: list[int], folder: Path) -> list[dict]:
    """`plait train --nproc 1` for one step on sparse corpora of each size (`sparse_corpus`): the
    time from the process's start to its first step's metrics line, and the corpus bytes read
    meanwhile (the page cache's count, every process included), beside what each launch read
    before its checks sampled: every shard whole for its sha256, timed here the same way."""

    rows = []
    for gb in sizes_gb:
        corpus = folder / f"sparse_{gb}gb"
        shutil.rmtree(corpus, ignore_errors=True)
        manifest = sparse_corpus(corpus, gb << 30)
        shards = sorted(corpus.glob("shard-*.bin"))
        metrics = folder / f"launch_{gb}gb.jsonl"
        start = time.time()
        proc = subprocess.run([sys.executable, "-m", "plait", "train", "--nproc", "1",
                               "--metrics", str(metrics), *overrides, f"data.source={corpus}",
                               "train.steps=1", "train.eval_batches=1", "train.warmup_steps=0"],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"plait train on {corpus} failed:\n{proc.stderr[-3000:]}")
        launch = os.stat(metrics).st_mtime - start
        read = sum(cached_bytes(f) for f in shards)
        start = time.perf_counter()
        for shard in shards:  # what every launch did before: each shard read for its sha256
            digest = hashlib.sha256()
            with open(shard, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
        whole = time.perf_counter() - start
        rows.append({"gib": gb, "shards": len(manifest["shards"]), "launch_s": launch,
                     "read_bytes": read, "sha256_s": whole})
        shutil.rmtree(corpus, ignore_errors=True)
    table = Table(title="plait train --nproc 1, one step, on prepared corpora of sparse shards: "
                  "process start to the first step's metrics line")
    for col in ("corpus", "shards", "launch", "corpus read", "before: + sha256 of every shard",
                "before"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['gib']:,} GiB", f"{r['shards']:,}", f"{r['launch_s']:.1f} s",
                      _mb(r["read_bytes"]), f"{r['sha256_s']:.1f} s",
                      f"{r['launch_s'] + r['sha256_s']:.1f} s")
    Console(width=150).print(table)
    return rows
