"""``ups report``: a run folder's metrics summarised in a table and plotted into a PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..plugin._records import CommandRunner
from ._common import EXIT_OK


def command(parser: argparse.ArgumentParser) -> CommandRunner:
    """Add ``ups report``'s arguments to ``parser``; return what runs it."""
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's folder")
    parser.add_argument(
        "--output",
        type=Path,
        metavar="PATH",
        help="the figure's file (default: RUN_DIR/report.png)",
    )
    return _report


def _report(args: argparse.Namespace) -> int:
    """``ups report``: the summary table first, which needs no matplotlib, then the figure;
    without matplotlib, a line saying what draws it (an error when ``--output`` asked for it)."""
    from ..observe._summary import NoMatplotlibError, write_report

    try:
        output, _ = write_report(args.run_dir, args.output, show=print)
    except NoMatplotlibError as error:
        if args.output is not None:
            raise
        print(f"plot: not drawn: {error}")
        return EXIT_OK
    print(f"plot: {output}")
    return EXIT_OK
