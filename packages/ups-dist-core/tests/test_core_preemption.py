"""Preemption: a signal to any rank becomes a stop every rank agrees on, at one step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ups.core import RunContext
from ups.core.dist._preemption import CHECK_EVERY_S, Preemption
from ups.core.testing import events, run_ranks


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


SIGNAL_WHILE_LOGGING = """
import os, signal, sys
from pathlib import Path

from ups.core import Preemption, RunContext
from ups.core.observe import _logs as logs

ctx = RunContext()
logs.configure(ctx)
with logs.rank_log_file(ctx, Path(sys.argv[1])), Preemption(ctx) as preemption:
    [tee] = [p for p in logs.structlog.get_config()["processors"] if isinstance(p, logs._RankFile)]
    with tee._lock:  # as if this rank were writing a log line when the signal comes
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(1000):  # the handler runs at one of these bytecodes, lock held
            pass
    assert preemption.agreed()
print("stopped")
"""


def test_a_signal_while_the_rank_writes_a_log_line_does_not_hang_it(tmp_path: Path) -> None:
    """The handler only notes the signal; the warning is logged by ``agreed()``: a handler
    that logged waited forever for the log file's lock its own thread held (a rank hung so in
    CI, mid-way through a line, when SLURM's preemption notice came)."""
    result = subprocess.run(
        [sys.executable, "-c", SIGNAL_WHILE_LOGGING, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "stopped"
    assert (
        events(
            tmp_path / "logs" / "rank0.jsonl",
            "preemption signal: saving at the next step boundary, then stopping",
        )[0]["signal"]
        == "SIGUSR1"
    )
