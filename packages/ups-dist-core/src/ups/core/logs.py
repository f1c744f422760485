"""Configure structlog once, at the entry point: rank 0 reports, the other ranks only warn.

Libraries (and plugins) just call ``structlog.get_logger()``; this module is for entry points.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Literal

import structlog
from structlog.typing import EventDict, WrappedLogger

from .context import RunContext

FORMAT_ENV = "UPS_LOG_FORMAT"
Format = Literal["auto", "json", "console"]


class AddRank:
    """Processor: adds ``rank`` to every event of a multi-process run."""

    def __init__(self, ctx: RunContext) -> None:
        self._rank = ctx.rank if ctx.world_size > 1 else None

    def __call__(self, _logger: WrappedLogger, _name: str, event: EventDict) -> EventDict:
        if self._rank is not None:
            event.setdefault("rank", self._rank)
        return event


def configure(ctx: RunContext, level: str = "info", fmt: Format | None = None) -> None:
    """Send structured logs to stderr: ``level`` and above on rank 0, warnings and above elsewhere.

    ``fmt``: ``json`` (one object a line), ``console`` (for people), or ``auto``: console on a
    terminal, else JSON. Defaults to ``$UPS_LOG_FORMAT`` or ``auto``.
    """
    fmt = fmt or os.environ.get(FORMAT_ENV, "auto")  # type: ignore[assignment]
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    threshold = logging.getLevelNamesMapping()[level.upper()]
    if not ctx.is_main:
        threshold = max(threshold, logging.WARNING)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            AddRank(ctx),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        # One write a line (PrintLogger writes the newline apart): lines of two ranks sharing
        # a pipe interleave whole, never mid-line.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
