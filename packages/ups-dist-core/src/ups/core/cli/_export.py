"""``ups export``: a run's trained weights out of its folder, as a plain ``state_dict`` file
that ``torch.load(PATH, weights_only=True)`` reads, for use without ups."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..checkpoint._weights import WHICH, export_weights
from ..plugin._records import CommandRunner
from ._common import EXIT_OK


def command(parser: argparse.ArgumentParser) -> CommandRunner:
    """Add ``ups export``'s arguments to ``parser``; return what runs it."""
    parser.add_argument(
        "run_dir",
        type=Path,
        metavar="RUN_DIR",
        help="the run's folder (its newest checkpoint), or a checkpoint folder",
    )
    parser.add_argument(
        "--weights",
        default="latest",
        choices=WHICH,
        help="latest (the newest checkpoint's), ema (its average of the weights, "
        "training.ema) or best (the checkpoint the run's 'best' pointer names, "
        "checkpoint.options.keep_best); default: latest",
    )
    parser.add_argument(
        "--output", required=True, type=Path, metavar="PATH", help="the state_dict's file"
    )
    return _export


def _export(args: argparse.Namespace) -> int:
    """``ups export``: write the weights, say where from."""
    read = export_weights(
        args.run_dir, args.output, args.weights, key="RUN_DIR", weights_key="--weights"
    )
    print(f"ups: wrote the weights of {read.source} to {args.output}")
    return EXIT_OK
