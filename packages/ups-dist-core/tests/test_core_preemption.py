"""Preemption: a signal to any rank becomes a stop every rank agrees on, at one step."""

from __future__ import annotations

import os
import signal

from ups.core import RunContext
from ups.core.preemption import Preemption
from ups.core.testing import run_ranks


def polls_until_stopped(ctx: RunContext, signalled_rank: int, at: int) -> int:
    with Preemption(ctx, [signal.SIGUSR1]) as preemption:
        for poll in range(1, 100):
            if ctx.rank == signalled_rank and poll == at:
                os.kill(os.getpid(), signal.SIGUSR1)
            if preemption.agreed():
                return poll
    raise AssertionError("never stopped")


def test_every_rank_stops_at_the_same_step_one_after_the_signal() -> None:
    assert run_ranks(polls_until_stopped, 2, 1, 5) == [6, 6]


def test_one_process_stops_at_once_and_gets_its_handler_back() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with Preemption(RunContext(), [signal.SIGUSR1]) as preemption:
        assert not preemption.agreed()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.agreed() and preemption.stopped
        assert preemption.received is signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == before


def test_no_signal_watched_never_stops() -> None:
    with Preemption(RunContext(), []) as preemption:
        assert not preemption.agreed()
        assert not preemption.stopped
