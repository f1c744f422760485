"""Preemption: a signal (SIGTERM, SIGUSR1) becomes a stop every rank agrees on, at one step.

Schedulers warn a job before they kill it: SLURM sends SIGUSR1 (``--signal``) or SIGTERM,
torchrun's agent forwards SIGTERM, a cloud spot instance gets SIGTERM. The ranks do not get the
signal at the same step, or at all (SLURM may signal the batch step only), so no rank may act
on its own: at agreed steps every rank posts whether it was signalled to an all-reduce that
runs in the background, and reads the previous one's result; soon after any rank was
signalled (two checks, about :data:`CHECK_EVERY_S` seconds apart, where steps are short;
every step where they are long), every rank learns it at the same step, saves, and stops.
The ranks agree on the steps between checks in the same all-reduce: each proposes as many as
take about :data:`CHECK_EVERY_S` of its time, and the fewest proposed counts. The cost is one
asynchronous all-reduce of two numbers per check, never waited for while it runs (none when
no signal is watched), and no per-step collective on a model whose steps are short: fewer
collectives posted from Python, each of which has gloo's thread create a Python thread state
when it lets go of the tensor (the moment a fork can deadlock on Python before 3.11.8,
CPython gh-112275).
"""

from __future__ import annotations

import signal
import threading
import time
import types
from collections.abc import Iterable
from typing import Any

import structlog
import torch
import torch.distributed as dist

from ..config._arguments import check_type, wrong_type, wrong_value
from ._context import RunContext

log = structlog.get_logger()

Handler = Any
"""What :func:`signal.signal` returns: a callable, an int, or ``None``."""

CHECK_EVERY_S = 0.1
"""About how many seconds of training pass between two checks for a signal."""
MOST_STEPS = 1000
"""The most steps between two checks."""
UNCATCHABLE = frozenset(
    getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)
)
"""The signals no handler can be installed for."""


CATCHABLE = "signals a handler can catch, such as signal.SIGTERM, signal.SIGUSR1"


def caught_signals(signals: object) -> tuple[signal.Signals, ...]:
    """``signals`` as a tuple, each a :class:`signal.Signals` that a handler can catch.

    :raises ArgumentTypeError: naming ``signals``, for what is not an iterable of signals.
    :raises ArgumentValueError: naming ``signals``, for ``SIGKILL`` or ``SIGSTOP``.
    """
    if isinstance(signals, signal.Signals) or not isinstance(signals, Iterable):
        raise wrong_type("signals", signals, f"an iterable of {CATCHABLE}")
    found = tuple(signals)
    for sig in found:
        check_type("signals", sig, signal.Signals, CATCHABLE)
        if sig in UNCATCHABLE:
            raise wrong_value("signals", sig, CATCHABLE)
    return found


class Preemption:
    """Watches for ``signals`` while entered (handlers are installed from the main thread).

    In a loop of one's own: every rank calls :meth:`agreed` once per step, and all save and
    stop at the step it says ``True``.

    :raises ConfigError: naming the argument: a ``ctx`` that is not a :class:`RunContext`,
        ``signals`` that are not :class:`signal.Signals` (an
        :class:`~ups.core.config._arguments.ArgumentTypeError`, a ``TypeError`` too) or that no
        handler can catch (``SIGKILL``, ``SIGSTOP``: a ``ValueError`` too).
    """

    def __init__(
        self,
        ctx: RunContext,
        signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGUSR1),
    ) -> None:
        check_type("ctx", ctx, RunContext, "a RunContext (from ups.core.distributed_session)")
        self.ctx = ctx
        self.signals = caught_signals(signals)
        self.received: signal.Signals | None = None
        """The signal this rank got, if any."""
        self.stopped = False
        """Whether the ranks agreed to stop (:meth:`agreed` said so)."""
        self._previous: dict[signal.Signals, Handler] = {}
        device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
        self._posted = torch.zeros(2, dtype=torch.int64, device=device)
        """Posted to each check's all-reduce: signalled (0 or 1), minus the steps proposed
        until the next check (so that the maximum is the fewest)."""
        self._work: dist.Work | None = None
        self._calls = 0
        self._due = 1
        """The call that checks next."""
        self._checked: tuple[int, float] | None = None
        """The call that checked last, and when."""
        self._said = False
        """Whether this rank has logged the signal it got (at its first call after it)."""

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_: object) -> None:
        if self._work is not None:  # every rank posted it: every rank waits for it
            self._work.wait()
            self._work = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self) -> bool:
        """Whether the ranks agree to stop here, some rank having been signalled (every rank
        calls this once per step; the answer is the same on every rank, at the same call)."""
        if self.received is not None and not self._said:
            self._said = True
            log.warning(
                "preemption signal: saving at the next step boundary, then stopping",
                signal=self.received.name,
                rank=self.ctx.rank,
            )
        if not self.ctx.distributed or not self.signals:  # nothing to agree on
            self.stopped = self.received is not None
            return self.stopped
        self._calls += 1
        if self._calls < self._due:
            return False
        stop, steps = False, 1
        if self._work is not None:
            self._work.wait()
            signalled, fewest = self._posted.tolist()
            stop, steps = bool(signalled), -fewest
        if stop:
            self._work = None
        else:
            self._posted.copy_(torch.tensor([int(self.received is not None), -self._proposal()]))
            self._work = dist.all_reduce(self._posted, op=dist.ReduceOp.MAX, async_op=True)
        self._due = self._calls + steps
        self.stopped = stop
        return stop

    def _proposal(self) -> int:
        """The steps this rank proposes until the next check: about :data:`CHECK_EVERY_S` of
        its time, as long as its steps took since the last check (1 at the first)."""
        now = time.monotonic()
        last, self._checked = self._checked, (self._calls, now)
        if last is None:
            return 1
        per_step = (now - last[1]) / (self._calls - last[0])
        return max(1, min(MOST_STEPS, int(CHECK_EVERY_S / max(per_step, 1e-9))))

    def _handle(self, signum: int, _frame: types.FrameType | None) -> None:
        # No logging here: the handler runs between two bytecodes of the main thread, which
        # may hold the log file's lock right then (a rank hung so, in CI); agreed() says it.
        sig = signal.Signals(signum)
        if self.received is None:
            self.received = sig
        # A second signal acts as it would have without us.
        signal.signal(sig, self._previous.get(sig, signal.SIG_DFL))
