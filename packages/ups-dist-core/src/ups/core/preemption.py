"""Preemption: a signal (SIGTERM, SIGUSR1) becomes a stop every rank agrees on, at one step.

Schedulers warn a job before they kill it: SLURM sends SIGUSR1 (``--signal``) or SIGTERM,
torchrun's agent forwards SIGTERM, a cloud spot instance gets SIGTERM. The ranks do not get the
signal at the same step, or at all (SLURM may signal the batch step only), so no rank may act
on its own: each step every rank posts whether it was signalled to an all-reduce that runs in
the background, and reads the previous step's result. One step after any rank was signalled,
every rank learns it at the same step, saves, and stops. The cost is one asynchronous
all-reduce of one number per step, never waited for while it runs (none when no signal is
watched).
"""

from __future__ import annotations

import signal
import threading
import types
from collections.abc import Iterable
from typing import Any

import structlog
import torch
import torch.distributed as dist

from .context import RunContext
from .errors import ConfigError

log = structlog.get_logger()

Handler = Any
"""What :func:`signal.signal` returns: a callable, an int, or ``None``."""


class Preemption:
    """Watches for ``signals`` while entered (handlers are installed from the main thread).

    In a loop of one's own: every rank calls :meth:`agreed` once per step, and all save and
    stop at the step it says ``True``.

    :raises ConfigError: when one of ``signals`` is not a :class:`signal.Signals`.
    """

    def __init__(
        self,
        ctx: RunContext,
        signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGUSR1),
    ) -> None:
        self.ctx = ctx
        self.signals = tuple(signals)
        for sig in self.signals:
            if not isinstance(sig, signal.Signals):
                raise ConfigError(
                    "signals",
                    f"{sig!r} is not a signal; allowed: signal.SIGTERM, signal.SIGUSR1, ...",
                )
        self.received: signal.Signals | None = None
        """The signal this rank got, if any."""
        self.stopped = False
        """Whether the ranks agreed to stop (:meth:`agreed` said so)."""
        self._previous: dict[signal.Signals, Handler] = {}
        device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._work: dist.Work | None = None

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
        """Whether any rank was signalled by the previous call (every rank calls this once
        per step; the answer is the same on every rank)."""
        if not self.ctx.distributed or not self.signals:  # nothing to agree on
            self.stopped = self.received is not None
            return self.stopped
        stop = False
        if self._work is not None:
            self._work.wait()
            stop = bool(self._flag.item())
        if not stop:
            self._flag.fill_(int(self.received is not None))
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)
        else:
            self._work = None
        self.stopped = stop
        return stop

    def _handle(self, signum: int, _frame: types.FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is None:
            self.received = sig
            log.warning(
                "preemption signal: saving at the next step boundary, then stopping",
                signal=sig.name,
                rank=self.ctx.rank,
            )
        # A second signal acts as it would have without us.
        signal.signal(sig, self._previous.get(sig, signal.SIG_DFL))
