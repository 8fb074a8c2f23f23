"""`plait data prepare SRC... OUT --tokenizer T [--field F] [--workers N]`: a corpus of token ids
for `data.source = OUT` (`plait/train/prepare.py`); `plait data verify OUT [--sample N]`: its
shards read whole against their checksums and the vocabulary (a launch checks sizes and a sample
only). Bad input exits with status 2 and one line."""

from __future__ import annotations

import argparse

from plait.train.corpus import SHARD_TOKENS


def add_data(sub, parser_class) -> None:
    data = sub.add_parser("data", help="prepare a corpus: tokenize text into memory-mapped shards")
    commands = data.add_subparsers(dest="data_command", required=True, parser_class=parser_class)
    prepare = commands.add_parser(
        "prepare", help="tokenize text files, folders, JSONL / Parquet / Arrow tables into OUT")
    prepare.add_argument("paths", nargs="+", metavar="SRC... OUT",
                         help="text files or folders (a file is a document), JSONL / Parquet / "
                         "Arrow files (a row is a document); then the folder to write")
    prepare.add_argument("--tokenizer", required=True, metavar="T",
                         help="a tokenizer.json, a Hugging Face model folder holding one, bpe:N "
                         "(train a byte-level BPE of N tokens on SRC) or bytes")
    prepare.add_argument("--field", default="text", help="the text's field in table rows")
    prepare.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    prepare.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, metavar="N",
                         help=f"ids per shard file (default {SHARD_TOKENS:,})")
    prepare.add_argument("--follow-links", action="store_true",
                         help="read files that links in a source folder point to outside it")
    prepare.set_defaults(func=cmd_data_prepare)
    verify = commands.add_parser(
        "verify", help="read a prepared corpus whole: each shard's sha256 and every id")
    verify.add_argument("folder", metavar="OUT", help="a folder plait data prepare wrote")
    verify.add_argument("--sample", type=int, default=0, metavar="N",
                        help="N shards chosen at random (default: every shard)")
    verify.set_defaults(func=cmd_data_verify)


def cmd_data_prepare(args: argparse.Namespace) -> None:
    from plait.config import ConfigError
    from plait.train.prepare import prepare

    if len(args.paths) < 2:
        raise ConfigError("OUT", "name the sources, then the folder to write (SRC... OUT)")
    *sources, out = args.paths
    done = prepare(sources, out, args.tokenizer, args.field, args.workers,
                   args.shard_tokens, follow_links=args.follow_links)
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
    import random
    import time
    from pathlib import Path

    from plait.config import ConfigError
    from plait.train.corpus import CorpusError, is_prepared, read_manifest, verify_shards

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
        picked = random.sample(shards, args.sample) if 0 < args.sample < len(shards) else shards
        verify_shards(folder, {**manifest, "shards": picked}, checksums=True, key="OUT")
    except CorpusError as e:
        raise ConfigError(e.key, e.message) from None
    print(f"{folder}: {len(picked)} of {len(shards)} shard(s), "
          f"{sum(s['tokens'] for s in picked):,} ids: checksums and ids as prepared "
          f"({time.perf_counter() - start:.1f} s)")
