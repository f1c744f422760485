"""A progress bar on rank 0's terminal, and console writes that never land in the middle of it.

The bar is for people watching a terminal: on other output (CI, a log file) there is none, and
the structured logs are the record. :func:`write_line` is how the console logger of
:mod:`ups.core.observe._logs` writes, so log lines and the bar share the terminal cleanly.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, NoReturn, TextIO

from tqdm import tqdm

if TYPE_CHECKING:
    from ..dist._context import RunContext

SHOWN = ("loss", "loss/", "val_loss", "samples_per_s")
"""The metrics the bar shows, in this order, when :meth:`Progress.update` is given them:
``loss``, every ``loss/<task>`` (as ``<task>``), ``val_loss`` and ``samples_per_s`` (as
``samples/s``); the bar itself shows the steps, their rate and the time left."""

_NO_METRICS: Mapping[str, float] = types.MappingProxyType({})
_OPEN: set[Progress] = set()
_LOCK = threading.Lock()


def write_line(file: TextIO, line: str) -> None:
    """Write ``line`` and a newline to ``file`` in one write, so lines of processes sharing a
    pipe interleave whole; while a :class:`Progress` bar is open, clear it before and redraw it
    after, so the line never lands in the middle of the bar."""
    with _LOCK, tqdm.external_write_mode(file=file) if _OPEN else contextlib.nullcontext():
        file.write(line + "\n")
        file.flush()


def postfix(metrics: Mapping[str, float]) -> str:
    """The :data:`SHOWN` entries of ``metrics``, as the bar shows them after its counts."""
    shown = []
    for prefix in SHOWN:
        for key, value in metrics.items():
            if key == prefix or (prefix.endswith("/") and key.startswith(prefix)):
                if key == "samples_per_s":
                    shown.append(f"{value:.0f} samples/s")
                else:
                    shown.append(f"{key.removeprefix(prefix) or key}={value:.4g}")
    return ", ".join(shown)


class Progress:
    """A progress bar of training steps on rank 0: steps/s, the time left, and the latest
    numbers a person watches (:data:`SHOWN`).

    ``enabled`` defaults to whether ``file`` (default: stderr) is a terminal; other ranks never
    show a bar. A disabled bar costs one attribute check per :meth:`update`. Use it as a context
    manager, or call :meth:`close`.
    """

    def __init__(
        self,
        ctx: RunContext,
        total: int | None,
        *,
        file: TextIO | None = None,
        enabled: bool | None = None,
        refresh_s: float = 0.5,
    ) -> None:
        """``total``: the number of steps, or ``None`` when unknown (no percentage, no ETA).
        ``refresh_s``: the shortest time between two updates of the shown metrics."""
        stream = sys.stderr if file is None else file
        if enabled is None:
            enabled = stream.isatty()
        self._refresh_s = refresh_s
        self._due = 0.0
        self._shown: dict[str, float] = {}
        self._pending = False
        self._bar: tqdm[NoReturn] | None = None
        self._on_terminal = ctx.is_main and enabled
        if self._on_terminal:
            self._bar = tqdm(total=total, file=stream, unit="step", dynamic_ncols=True)
            _OPEN.add(self)

    @property
    def enabled(self) -> bool:
        """Whether this bar is shown (and not yet closed)."""
        return self._bar is not None

    @property
    def on_terminal(self) -> bool:
        """Whether this bar is or was shown: the numbers it shows go to no log line."""
        return self._on_terminal

    def update(self, step: int, metrics: Mapping[str, float] = _NO_METRICS) -> None:
        """Advance the bar to ``step`` (steps done so far) and show the :data:`SHOWN` entries of
        ``metrics`` in place of those shown; the others shown stay."""
        bar = self._bar
        if bar is None:
            return
        if metrics:
            self._shown.update(metrics)
            self._pending = True
        if self._pending:
            now = time.monotonic()
            if now >= self._due:
                self._show_pending()
                self._due = now + self._refresh_s
        bar.update(step - bar.n)

    def close(self) -> None:
        """Show the latest metrics and leave the bar's final state on its line; idempotent."""
        if self._bar is None:
            return
        self._show_pending()
        _OPEN.discard(self)
        self._bar.close()
        self._bar = None

    def _show_pending(self) -> None:
        if self._bar is not None and self._pending:
            self._bar.set_postfix_str(postfix(self._shown), refresh=False)
            self._pending = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
