"""The step watchdog: a rank that stops answering inside a training step is named, and every
rank stops, within ``distributed.timeout_s`` and a grace.

A collective whose peer never comes fails after its timeout with a message that names no rank
(gloo: "Timed out waiting ... for recv"; NCCL's watchdog aborts the process), or never fails at
all. So each rank marks its progress through a step (started, forward begun, forward done, step
done: a tuple of two ints, no I/O), and a thread of its own notices when the mark has not moved
for ``timeout_s``. It then posts the mark to the job's key-value store (the process group's
TCPStore, which works under every backend) and waits, up to half of the grace
(:func:`~ups.core.context.collective_timeout`), for the other ranks' marks, posted by their own
watchdogs, which look for such a request once a poll (one store lookup a second):

- ranks whose mark is behind the others' (still in the forward pass while the others wait in
  the backward's all-reduce), or that post nothing (dead, or their host gone), are named;
  every rank that took part logs the verdict, records it where the elastic agent reads a
  rank's error (so ``ups train`` prints it) and exits with status 1, and the agent stops the
  rest (or restarts them, with ``distributed.max_restarts``);
- when every rank posted the same mark, all are merely slow (a long checkpoint, evaluation or
  compilation): a warning, and the watch goes on.

The process group's own timeout is the grace longer, so the watchdog speaks first.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
import typing
from collections.abc import Sequence

import structlog
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from .context import RunContext, collective_timeout

log = structlog.get_logger()

Mark = tuple[int, int]
"""Where a rank is: ``(attempted step, phase)``; later marks compare greater."""
STARTED, FORWARD, FORWARD_DONE, DONE = range(4)
"""The phases of a step."""
ASKED = "asked"
"""The key a stalled rank sets: every rank's watchdog then posts its mark, stalled or not."""
PHASES = ("at the start of", "in the forward pass of", "after the forward pass of", "at the end of")


class HangError(RuntimeError):
    """Ranks stopped answering inside a step; the message names them."""


def verdict(marks: Sequence[Mark | None], timeout_s: float) -> str | None:
    """The error naming the silent ranks, from every rank's mark (``None``: it posted none);
    ``None`` when every rank is at the same mark (slow, not silent)."""
    posted = [mark for mark in marks if mark is not None]
    ahead = max(posted)
    silent = [rank for rank, mark in enumerate(marks) if mark is None or mark < ahead]
    if not silent:
        return None
    where = []
    for rank in silent:
        mark = marks[rank]
        if mark is None:
            where.append(f"rank {rank} did not answer (its process or host is gone)")
        else:
            where.append(f"rank {rank} is {PHASES[mark[1]]} step {mark[0]}")
    waiting = [rank for rank, mark in enumerate(marks) if mark == ahead]
    return (
        f"rank {', '.join(map(str, silent))} stopped answering: no progress for {timeout_s:g} s "
        f"(distributed.timeout_s); {'; '.join(where)}, while rank "
        f"{', '.join(map(str, waiting))} waited {PHASES[ahead[1]]} step {ahead[0]}"
    )


class Watchdog:
    """Watches this rank's progress through the steps while entered (distributed runs only).

    ``key`` tells this run's marks from another's in the store (the same on every rank; by
    default the launcher's restart count, which torchrun gives every rank alike). In a loop of
    one's own, call :meth:`mark` with the step at the start of each step.
    """

    def __init__(self, ctx: RunContext, key: str | None = None) -> None:
        self.ctx = ctx
        self.timeout_s = ctx.timeout_s
        self._answer_s = (collective_timeout(ctx.timeout_s) - ctx.timeout_s) / 2
        self._key = str(ctx.restart_count) if key is None else key
        self._mark: Mark = (0, DONE)
        self._moved = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._round = 0

    def mark(self, step: int, phase: int = STARTED) -> None:
        """This rank reached ``phase`` of its ``step``-th attempted step (cheap: no I/O)."""
        self._mark, self._moved = (step, phase), time.monotonic()

    def __enter__(self) -> Watchdog:
        if self.ctx.distributed:
            self._moved = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="ups-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll):
            store = self.store()
            stalled = time.monotonic() - self._moved >= self.timeout_s
            try:  # a rank whose mark moves answers when a stalled one asks
                if not stalled and not store.check([ASKED]):
                    continue
                marks = self.exchange(store)
            except RuntimeError as error:  # the store's host (rank 0, or the agent) is gone
                self._fail(f"the job's key-value store stopped answering ({error})")
            message = verdict(marks, self.timeout_s)
            if message is not None:
                if self.ctx.is_main:  # it may host the store: the others read first
                    self._wait(store, [f"read/{r}" for r, m in enumerate(marks) if m is not None])
                self._fail(message)
            if self.ctx.is_main:
                log.warning(
                    "no rank made progress: every rank is slow, none is silent",
                    seconds=self.timeout_s,
                    step=self._mark[0],
                )
            self._round += 1
            self._moved = time.monotonic()

    def store(self) -> dist.distributed_c10d.Store:
        """The job's store, under the prefix of the current exchange (every rank that takes
        part in an exchange moves on to the next one's)."""
        return dist.distributed_c10d.PrefixStore(
            f"ups/watchdog/{self._key}/{self._round}", dist.distributed_c10d._get_default_store()
        )

    def exchange(self, store: dist.distributed_c10d.Store) -> list[Mark | None]:
        """Post this rank's mark (asking the others to post theirs) and read every rank's,
        waiting up to the answer time; ``None`` for a rank that posted none."""
        step, phase = self._mark
        store.set(str(self.ctx.rank), f"{step} {phase}")
        store.set(ASKED, "")
        keys = [str(rank) for rank in range(self.ctx.world_size)]
        self._wait(store, keys)
        marks: list[Mark | None] = []
        for key in keys:
            if store.check([key]):
                step, phase = map(int, store.get(key).decode().split())
                marks.append((step, phase))
            else:
                marks.append(None)
        store.set(f"read/{self.ctx.rank}", "")
        return marks

    def _wait(self, store: dist.distributed_c10d.Store, keys: list[str]) -> None:
        """Wait for ``keys``, up to the answer time (a rank that never answers: not there)."""
        with contextlib.suppress(dist.DistStoreError):
            store.wait(keys, datetime.timedelta(seconds=self._answer_s))

    def _fail(self, message: str) -> typing.NoReturn:
        """Log the verdict, leave it where the elastic agent reads this rank's error, exit."""
        log.error("ranks stopped answering", error=message, rank=self.ctx.rank)
        ErrorHandler().record_exception(HangError(message))
        print(f"HangError: {message}", file=sys.stderr, flush=True)
        os._exit(1)
