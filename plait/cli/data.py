"""`plait data prepare SRC... OUT --tokenizer T [--field F] [--workers N]`: a corpus of token ids
for `data.source = OUT` (`plait/data/tokenize_corpus.py`); `plait data verify OUT [--sample N]`: its
shards read whole against their checksums and the vocabulary (a launch checks sizes and a sample
only). Bad input exits with status 2 and one line."""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from plait.config.schema import ConfigError


def cmd_data_prepare(args: argparse.Namespace) -> None:
    # here, not at the top: the command line's refusals import no torch
    from plait.data.corpus import SHARD_TOKENS
    from plait.data.tokenize_corpus import prepare

    if len(args.paths) < 2:
        raise ConfigError("OUT", "name the sources, then the folder to write (SRC... OUT)")
    *sources, out = args.paths
    shard = SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens
    done = prepare(sources, out, args.tokenizer, args.field, args.workers, shard,
                   follow_links=args.follow_links)
    if done["skipped"]:
        names = ", ".join(done["skipped"][:3]) + (", ..." if len(done["skipped"]) > 3 else "")
        print(f"skipped {len(done['skipped'])} file(s) that are not UTF-8 text: {names} (all "
              f"named in {out}/manifest.json)")
    print(f"{out}: {done['documents']:,} documents, {done['tokens']:,} tokens ({done['dtype']}, "
          f"vocabulary {done['vocab_size']:,}) in {len(done['shards'])} shard(s); "
          f"{done['tokens_per_s']:,.0f} tokens/s on {args.workers} worker(s) "
          f"({done['tokens_per_s'] / args.workers:,.0f} per worker); "
          f"train on it with data.source={out}")


def cmd_data_verify(args: argparse.Namespace) -> None:
    # here, not at the top: the command line's refusals import no torch
    from plait.data.corpus import CorpusError, is_prepared, read_manifest, verify_shards

    folder = Path(args.folder)
    if not is_prepared(args.folder):
        raise ConfigError("OUT", f"{folder} has no manifest.json: not a corpus plait data "
                          "prepare wrote")
    if args.sample < 0:
        raise ConfigError("--sample", f"shards to read, 0 for all; got {args.sample}")
    start = time.perf_counter()
    try:
        manifest = read_manifest(folder)
        shards = manifest["shards"]
        picked = sorted(random.sample(range(len(shards)), args.sample)) \
            if 0 < args.sample < len(shards) else list(range(len(shards)))
        unchecked = verify_shards(folder, manifest, checksums=True, key="OUT", only=picked)
    except CorpusError as e:
        raise ConfigError(e.key, e.message) from None
    if unchecked:
        print(f"note: {unchecked}")
    print(f"{folder}: {len(picked)} of {len(shards)} shard(s), "
          f"{sum(shards[i]['tokens'] for i in picked):,} ids: "
          f"{'sha256, block checksums' if not unchecked else 'sha256'} and ids as prepared "
          f"({time.perf_counter() - start:.1f} s)")
