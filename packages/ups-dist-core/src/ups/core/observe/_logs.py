"""Configure structlog once, at the entry point: rank 0 reports, the other ranks only warn; each
rank can also keep every event of its own in a file of the run.

Libraries (and plugins) just call ``structlog.get_logger()``; this module is for entry points.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TextIO, cast

import structlog
from structlog.typing import EventDict, WrappedLogger

from ._progress import write_line

if TYPE_CHECKING:
    from ..dist._context import RunContext

FORMAT_ENV = "UPS_LOG_FORMAT"
AGENT_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""Set in a rank's environment by an elastic agent: where the rank leaves its error, which the
agent's launcher (``ups train --nproc``, torchrun) prints."""
Format = Literal["auto", "json", "console"]

_LEVELS = logging.getLevelNamesMapping()


def _level_name(method_name: str) -> str:
    """The level of an event logged by the method ``method_name``, as structlog names it."""
    return {"warn": "warning", "exception": "error"}.get(method_name, method_name)


def _level_number(method_name: str) -> int:
    """The level of an event logged by the method ``method_name``, as a number (info if none)."""
    return _LEVELS.get(_level_name(method_name).upper(), logging.INFO)


class AddRank:
    """Processor: adds ``rank`` to every event of a multi-process run."""

    def __init__(self, ctx: RunContext | None) -> None:
        self._rank = ctx.rank if ctx is not None and ctx.world_size > 1 else None

    def __call__(self, _logger: WrappedLogger, _name: str, event: EventDict) -> EventDict:
        if self._rank is not None:
            event.setdefault("rank", self._rank)
        return event


class DropBelow:
    """Processor: drops events below ``level``, so the processors after it (the console's
    renderer) never see them. A rank's log file joins the chain before it."""

    def __init__(self, level: int) -> None:
        self._level = level

    def __call__(self, _logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
        if _level_number(name) < self._level:
            raise structlog.DropEvent
        return event


class _Console:
    """The structlog logger of the console: writes each rendered line to the stderr of the
    moment (not a stream a test has closed since) through :func:`~ups.core.observe._progress.write_line`:
    one write a line, around an open progress bar."""

    def msg(self, message: str) -> None:
        write_line(sys.stderr, message)

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def configure(ctx: RunContext | None, level: str = "info", fmt: Format | None = None) -> None:
    """Send structured logs to stderr: ``level`` and above on rank 0, warnings and above elsewhere.
    ``ctx`` is ``None`` in a process that is not (yet) a rank: the command line's.

    ``fmt``: ``json`` (one object a line), ``console`` (for people), or ``auto``: console on a
    terminal, else JSON. Defaults to ``$UPS_LOG_FORMAT`` or ``auto``.
    """
    fmt = fmt or os.environ.get(FORMAT_ENV, "auto")  # type: ignore[assignment]
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    threshold = _LEVELS[level.upper()]
    if ctx is not None and not ctx.is_main:
        threshold = max(threshold, logging.WARNING)
    console = _Console()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            AddRank(ctx),
            DropBelow(threshold),
            renderer,
        ],
        # Info events pass the logger even where the console drops them: a rank's log file
        # (rank_log_file) records them.
        wrapper_class=structlog.make_filtering_bound_logger(min(threshold, logging.INFO)),
        logger_factory=lambda *_: console,
        cache_logger_on_first_use=False,
    )


class _RankFile:
    """Processor: appends every event at info and above to ``stream`` as one JSON object a line
    (with ``level``, ``timestamp`` and ``rank``); passes the event on unchanged."""

    def __init__(self, stream: TextIO, rank: int) -> None:
        self._stream = stream
        self._rank = rank
        self._stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
        self._render = structlog.processors.JSONRenderer()
        self._lock = threading.Lock()

    def __call__(self, logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
        if _level_number(name) >= logging.INFO:
            self.write(name, event)
        return event

    def write(self, name: str, event: EventDict) -> None:
        """Append ``event``, logged by the method ``name``, as one line."""
        record: EventDict = dict(event)
        record.setdefault("level", _level_name(name))
        record.setdefault("rank", self._rank)
        if "timestamp" not in record:
            record = self._stamp(None, name, record)
        record = structlog.processors.format_exc_info(None, name, record)
        line = cast(str, self._render(None, name, record))  # json.dumps gives a str
        with self._lock:
            self._stream.write(f"{line}\n")


def to_file(level: str, event: str, **fields: object) -> None:
    """Log ``event`` at ``level`` to this rank's log file only (:func:`rank_log_file`), not to
    the console: what a person reads elsewhere (a traceback, a record the progress bar shows)."""
    for processor in structlog.get_config()["processors"]:
        if isinstance(processor, _RankFile):
            processor.write(level, {"event": event, **fields})


@contextlib.contextmanager
def rank_log_file(ctx: RunContext, run_dir: Path) -> Iterator[Path]:
    """While open, also append every event of this rank at info and above, whatever its console
    shows, to ``run_dir/logs/rank<rank>.jsonl`` (one JSON object a line); yield that path. An
    exception that leaves the block is written there too, with its traceback (``failed``).

    The file joins the structlog configuration in effect (normally :func:`configure`'s, so call
    that first) just before its console level filter, or else before its renderer, and leaves
    it on exit.
    """
    path = run_dir / "logs" / f"rank{ctx.rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Changed in place, as structlog.testing.capture_logs does: loggers bound earlier hold it.
    processors: list[structlog.typing.Processor] = structlog.get_config()["processors"]
    filters = [i for i, p in enumerate(processors) if isinstance(p, DropBelow)]
    # Line buffered: what a rank logged is on disk even if the run dies after it.
    with path.open("a", encoding="utf-8", buffering=1) as stream:
        tee = _RankFile(stream, ctx.rank)
        processors.insert(filters[0] if filters else max(0, len(processors) - 1), tee)
        try:
            yield path
        except BaseException as error:
            tee.write("error", {"event": "failed", "error": repr(error), "exc_info": error})
            raise
        finally:
            processors.remove(tee)
