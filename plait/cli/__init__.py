"""`plait train [--config FILE] [--nproc N] [--metrics FILE] [--tensorboard DIR] [--trace DIR]
[--nnodes N --rdzv-endpoint HOST:PORT] ...`
`plait run [--nproc N] [--preload MODULE] script.py [args ...]` (a user's script: `plait.init()`)
`plait bench comm | step | pp | compression | scaling | checkpoint | moe ...` (`bench.py`)
`plait plan --gpus N [--gpu h100] [...]`, `plait compare A.jsonl B.jsonl [--rtol R]`,
`plait report METRICS [--out DIR]`

Thin: parse, validate, launch. Bad input exits with status 2 and one line naming the field and the
fix, before any worker starts.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
import time

from plait.cli.commands import speaks
from plait.cli.spec import COMMANDS, add_commands
from plait.config.schema import ConfigError

# The package: the commands' options (spec.py), what they read (common.py), the commands
# (commands.py: train, run, plan, compare, report, convert; bench.py; data.py). A handler is
# imported when its command runs, so that a refusal imports no more than it needs.

REFUSAL_GRACE_S = 5.0  # how long a silent worker waits, refusing, for rank 0 to say why


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, status 2, like every other bad input
        print(f"plait: error: {message}", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    """Every command, from its description in `spec.py` (no handler imported yet)."""
    parser = _Parser(prog="plait", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_commands(sub, _Parser, COMMANDS)
    return parser


def console() -> None:
    """The `plait` command (and `python -m plait`): `main`, the exit handlers, and an end with
    `main`'s status without the interpreter's teardown of torch's modules, which takes ~1 s after
    a job has finished and would keep whoever reads its output waiting. Nothing of plait's is
    left to flush by then: the commands close their files, and the exit handlers run here."""
    try:
        main()
        status = 0
    except SystemExit as e:  # sys.exit(N), or a message (printed, status 1, as Python does)
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    # Overrides may come before or after options (`--nproc 4 parallel.tp=2`); argparse alone
    # would take only the first run of positionals.
    args, extra = parser.parse_known_args(argv)
    unknown = [word for word in extra if word.startswith("-") or "=" not in word]
    if unknown or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    module, name = args.handler.split(":")
    try:  # the handler's imports (torch, ...) only now: a bad key was refused before them
        getattr(importlib.import_module(module), name)(args)
    except ConfigError as e:
        if speaks():
            print(f"plait: error: {e}", file=sys.stderr)
        else:  # one of torchrun's other workers, which refuses alike and says nothing: rank 0
            # must end first, its line said, or torchrun stops it when this one ends
            time.sleep(REFUSAL_GRACE_S)
        sys.exit(2)
