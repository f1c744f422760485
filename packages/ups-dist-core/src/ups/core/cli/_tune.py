"""``ups tune``: the largest per-rank batch size that fits in memory on every rank, found by
``--nproc`` local processes (:mod:`ups.core.cli._tuning`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config._errors import UsageError
from ..plugin._manager import load_plugins
from ..plugin._records import CommandRunner
from ._common import EXIT_OK, add_overrides, check_config, count, run_config


def command(parser: argparse.ArgumentParser) -> CommandRunner:
    """Add ``ups tune``'s arguments to ``parser``; return what runs it."""
    parser.add_argument("config", type=Path)
    parser.add_argument("--nproc", type=count, help="processes on this machine")
    parser.add_argument("--start", type=int, default=1, help="the first batch size to try")
    parser.add_argument("--limit", type=int, help="the largest to try (default: a rank's data)")
    add_overrides(parser)
    return _tune


def _tune(args: argparse.Namespace) -> int:
    if args.start < 1 or (args.limit is not None and args.limit < args.start):
        raise UsageError(f"--start ({args.start}) must be >= 1 and --limit >= --start")
    from ..dist._context import launched
    from ..launch import _processes as launch

    config = run_config(args)
    nproc = args.nproc or config.distributed.nproc
    if not launched():
        check_config(config, load_plugins(), nproc)
    size = launch.tune(config, nproc=nproc, start=args.start, limit=args.limit)
    if not launched():  # launched ranks log it (rank 0)
        print(f"training.batch_size: {size} fits on every rank ({nproc} processes)")
    return EXIT_OK
