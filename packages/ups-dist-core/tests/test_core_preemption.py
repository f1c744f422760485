"""Preemption: a signal to any rank becomes a stop every rank agrees on, at one step."""

from __future__ import annotations

import os
import signal
import time

from ups.core import RunContext
from ups.core.dist._preemption import CHECK_EVERY_S, Preemption
from ups.core.testing import run_ranks


def polls_until_stopped(ctx: RunContext, signalled_rank: int, at: int, step_s: float) -> int:
    with Preemption(ctx, [signal.SIGUSR1]) as preemption:
        for poll in range(1, 1000):
            time.sleep(step_s)
            if ctx.rank == signalled_rank and poll == at:
                os.kill(os.getpid(), signal.SIGUSR1)
            if preemption.agreed():
                return poll
    raise AssertionError("never stopped")


def test_steps_longer_than_a_check_stop_every_rank_one_step_after_the_signal() -> None:
    assert CHECK_EVERY_S < 0.15
    assert run_ranks(polls_until_stopped, 2, 1, 5, 0.15) == [6, 6]


def test_short_steps_stop_every_rank_at_one_step_within_two_checks() -> None:
    stopped = run_ranks(polls_until_stopped, 2, 0, 30, 0.01)
    assert stopped[0] == stopped[1]
    assert 30 < stopped[0] <= 30 + 2 * CHECK_EVERY_S / 0.01 + 5


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
