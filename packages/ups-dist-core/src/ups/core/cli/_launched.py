"""``ups status``, ``logs`` and ``cancel``: the commands on a run ``ups launch`` started,
found by its launch record (:mod:`ups.core.launch._record`) and asked of its launcher."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from ..config._errors import UsageError
from ..launch._record import LaunchRecord, build_launcher, find_record, held_note
from ..plugin._manager import load_plugins
from ..plugin._records import TERMINAL, CommandRunner, Launcher
from ._common import EXIT_FAILED, EXIT_OK, LauncherError

T = TypeVar("T")

_RUN_HELP = "a launched run: its name (runs/RUN/launch.json), its folder or its launch.json"


def status_command(parser: argparse.ArgumentParser) -> CommandRunner:
    """Add ``ups status``'s arguments to ``parser``; return what runs it."""
    parser.add_argument("run", metavar="RUN", help=_RUN_HELP)
    return _status


def logs_command(parser: argparse.ArgumentParser) -> CommandRunner:
    """Add ``ups logs``'s arguments to ``parser``; return what runs it."""
    parser.add_argument("run", metavar="RUN", help=_RUN_HELP)
    parser.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="print new output until the run ends; exit 0 if it succeeded, else 1",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how often --follow asks the launcher (default: 2)",
    )
    return _logs


def cancel_command(parser: argparse.ArgumentParser) -> CommandRunner:
    """Add ``ups cancel``'s arguments to ``parser``; return what runs it."""
    parser.add_argument("run", metavar="RUN", help=_RUN_HELP)
    return _cancel


def call_launcher(launcher: str, method: str, call: Callable[[], T]) -> T:
    """``call()``; an exception other than a usage error becomes :class:`LauncherError`."""
    try:
        return call()
    except UsageError:
        raise
    except Exception as error:
        raise LauncherError(
            f"launcher {launcher!r}: {method} failed: {type(error).__name__}: {error}"
        ) from error


def _launched(run: str) -> tuple[LaunchRecord, Launcher]:
    path = find_record(run)
    record = LaunchRecord.read(path)
    return record, build_launcher(load_plugins(), record.launcher, record.options, str(path))


def _status(args: argparse.Namespace) -> int:
    record, launcher = _launched(args.run)
    state = call_launcher(record.launcher, "status", lambda: launcher.status(record.handle))
    print(state)
    note = held_note(state, args.run)
    if note is not None:
        print(f"ups: {args.run}: {note}", file=sys.stderr)
    return EXIT_OK


def _logs(args: argparse.Namespace) -> int:
    record, launcher = _launched(args.run)
    if not args.follow:
        text = call_launcher(record.launcher, "logs", lambda: launcher.logs(record.handle))
        sys.stdout.write(text)
        return EXIT_OK
    if args.interval <= 0:
        raise UsageError(f"--interval must be > 0, not {args.interval}")
    seen = ""
    while True:
        # The state first: logs read after a terminal state hold the job's last words.
        state = call_launcher(record.launcher, "status", lambda: launcher.status(record.handle))
        text = call_launcher(record.launcher, "logs", lambda: launcher.logs(record.handle))
        sys.stdout.write(text[len(seen) :] if text.startswith(seen) else text)
        sys.stdout.flush()
        seen = text
        if state in TERMINAL:
            note = held_note(state, args.run)
            print(f"ups: {args.run}: {state}" + (f": {note}" if note else ""), file=sys.stderr)
            return EXIT_OK if state == "SUCCEEDED" else EXIT_FAILED
        time.sleep(args.interval)


def _cancel(args: argparse.Namespace) -> int:
    record, launcher = _launched(args.run)
    call_launcher(record.launcher, "cancel", lambda: launcher.cancel(record.handle))
    print(call_launcher(record.launcher, "status", lambda: launcher.status(record.handle)))
    return EXIT_OK
