"""The step watchdog: a rank that stops answering inside a training step (or an evaluation) is
named, and every rank stops, within ``distributed.timeout_s`` and a grace.

A collective whose peer never comes fails after its timeout with a message that names no rank
(gloo: "Timed out waiting ... for recv"; NCCL's watchdog aborts the process), or never fails at
all. So each rank marks its progress through a step (started, forward begun, forward done,
backward begun, step done, in the evaluation after it: a tuple of two ints, no I/O; and the
config key of the user code it is in, where the engine knows it), and a thread of its own
notices when the mark has not moved for ``timeout_s``. It then posts the mark, with the
``torch.distributed`` collective the rank's training thread waits in (read from that thread's
stack), to the job's key-value store (the process group's TCPStore, which works under every
backend) and waits, up to half of the grace (:func:`~ups.core.dist._context.collective_timeout`), for
the other ranks' posts, made by their own watchdogs, which look for such a request once a poll
(one store lookup a second):

- ranks whose mark is behind the others' (still in the forward pass while the others wait in
  the backward's all-reduce; or waiting in a collective, such as a ``barrier`` in a metrics
  function, that the others never entered), or that post nothing (dead, or their host gone),
  are named; so are ranks at the same mark that all wait in collectives, not all the same one.
  Every rank that took part writes the verdict and its training thread's stack to its log
  file, records the verdict where the elastic agent reads a rank's error (so ``ups train``
  prints it, one line a rank) and exits with status 1, and the agent stops the rest (or
  restarts them, with ``distributed.max_restarts``);
- otherwise (every rank at the same mark, one of them working, not waiting), all are merely
  slow (a long checkpoint, evaluation or compilation): a warning, and the watch goes on.

The process group's own timeout is the grace longer, so the watchdog speaks first.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
import traceback
import typing
from collections.abc import Iterator, Sequence
from types import FrameType

import attrs
import structlog
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from ..observe import _logs as logs
from ._context import RunContext, collective_timeout

log = structlog.get_logger()

Mark = tuple[int, int]
"""Where a rank is: ``(attempted step, phase)``; later marks compare greater."""
STARTED, FORWARD, FORWARD_DONE, BACKWARD, DONE, EVALUATING = range(6)
"""The phases of a step; ``EVALUATING``: a forward pass of the evaluation after it."""
ASKED = "asked"
"""The key a stalled rank sets: every rank's watchdog then posts its mark, stalled or not."""
PHASES = (
    "at the start of",
    "in the forward pass of",
    "after the forward pass of",
    "in the backward pass of",
    "at the end of",
    "in the evaluation after",
)
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


_OWN_CODE = contextlib.nullcontext()
"""The context of ups's own code: nothing to tell."""


@attrs.frozen
class Post:
    """What a rank's watchdog posts: its mark, the ``torch.distributed`` collective its
    training thread waits in (``None``: none, it is working), and the config key of the user
    code it is in (``None``: not known to be in any)."""

    mark: Mark
    collective: str | None = None
    user: str | None = None

    def encode(self) -> str:
        return f"{self.mark[0]} {self.mark[1]} {self.collective or '-'} {self.user or '-'}"

    @classmethod
    def decode(cls, text: str) -> Post:
        step, phase, collective, user = text.split()
        return cls((int(step), int(phase)), _none(collective), _none(user))


def _none(text: str) -> str | None:
    return None if text == "-" else text


class HangError(RuntimeError):
    """Ranks stopped answering inside a step; the message names them."""


def verdict(posts: Sequence[Post | None], timeout_s: float) -> str | None:
    """The error naming the stuck ranks, from every rank's post (``None``: it posted none);
    ``None`` when every rank is at the same mark and some rank is working (slow, not stuck)."""
    ahead = max(post.mark for post in posts if post is not None)
    behind = [rank for rank, post in enumerate(posts) if post is None or post.mark < ahead]
    since = f"no progress for {timeout_s:g} s (distributed.timeout_s)"
    if not behind:
        collectives = {post.collective for post in posts if post is not None}
        if None in collectives or len(collectives) == 1:
            return None
        where = "; ".join(_where(rank, post) for rank, post in enumerate(posts))
        return f"the ranks wait in different collectives: {since}; {where}"
    others = [rank for rank in range(len(posts)) if rank not in behind]
    waits = [post.collective for r in behind if (post := posts[r]) and post.collective]
    if len(waits) == len(behind):  # every rank behind waits in a collective
        head = (
            f"rank {_ranks(behind)} waits in a collective ({', '.join(sorted(set(waits)))})"
            f" that rank {_ranks(others)} never entered"
        )
    else:
        head = f"rank {_ranks(behind)} stopped answering"
    where = "; ".join(_where(rank, posts[rank]) for rank in behind)
    waiting = [rank for rank, post in enumerate(posts) if post is not None and post.mark == ahead]
    return f"{head}: {since}; {where}, while rank {_ranks(waiting)} waited {_phase(ahead)}"


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _phase(mark: Mark) -> str:
    return f"{PHASES[mark[1]]} step {mark[0]}"


def _where(rank: int, post: Post | None) -> str:
    """Where ``rank`` is, in words."""
    if post is None:
        return f"rank {rank} did not answer (its process or host is gone)"
    text = f"rank {rank} is {_phase(post.mark)}"
    if post.user is not None:
        text += f", in user code called from {post.user}"
    if post.collective is not None:
        text += f", in {post.collective}"
    return text


def waiting_in(frame: FrameType | None) -> str | None:
    """The outermost public ``torch.distributed`` collective (``barrier``, ``all_reduce``, ...)
    that the stack of ``frame`` is in, or ``None``."""
    name = None
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_C10D) and not code.co_name.startswith("_"):
            name = code.co_name
        frame = frame.f_back
    return name


class Watchdog:
    """Watches this rank's progress through the steps while entered (distributed runs only):
    the thread that enters it is the one watched.

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
        self._user: str | None = None
        self._moved = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watched = threading.get_ident()
        self._round = 0

    def mark(self, step: int, phase: int = STARTED) -> None:
        """This rank reached ``phase`` of its ``step``-th attempted step (cheap: no I/O)."""
        self._mark, self._moved = (step, phase), time.monotonic()

    def phase(self, phase: int) -> None:
        """This rank reached ``phase`` of the step it marked last."""
        self._mark, self._moved = (self._mark[0], phase), time.monotonic()

    def calling(self, key: str | None) -> contextlib.AbstractContextManager[None]:
        """While open, this rank runs the user code that the config's ``key`` names (such as
        ``metrics.factory``; ``None``: ups's own code, which needs no telling: it costs
        nothing, several times a step): a verdict says so."""
        return _OWN_CODE if key is None else self._calling(key)

    @contextlib.contextmanager
    def _calling(self, key: str) -> Iterator[None]:
        self._user = key
        try:
            yield
        finally:
            self._user = None

    def __enter__(self) -> Watchdog:
        if self.ctx.distributed:
            self._moved = time.monotonic()
            self._watched = threading.get_ident()
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
                posts = self.exchange(store)
            except RuntimeError as error:  # the store's host (rank 0, or the agent) is gone
                self._fail(f"the job's key-value store stopped answering ({error})")
            message = verdict(posts, self.timeout_s)
            if message is not None:
                if self.ctx.is_main:  # it may host the store: the others read first
                    self._wait(store, [f"read/{r}" for r, p in enumerate(posts) if p is not None])
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

    def post(self) -> Post:
        """Where this rank is now: its mark, the collective its watched thread waits in, the
        user code it runs."""
        frame = sys._current_frames().get(self._watched)
        return Post(self._mark, waiting_in(frame), self._user)

    def exchange(self, store: dist.distributed_c10d.Store) -> list[Post | None]:
        """Post where this rank is (asking the others to post theirs) and read every rank's,
        waiting up to the answer time; ``None`` for a rank that posted none."""
        store.set(str(self.ctx.rank), self.post().encode())
        store.set(ASKED, "")
        keys = [str(rank) for rank in range(self.ctx.world_size)]
        self._wait(store, keys)
        posts = [Post.decode(store.get(k).decode()) if store.check([k]) else None for k in keys]
        store.set(f"read/{self.ctx.rank}", "")
        return posts

    def _wait(self, store: dist.distributed_c10d.Store, keys: list[str]) -> None:
        """Wait for ``keys``, up to the answer time (a rank that never answers: not there)."""
        with contextlib.suppress(dist.DistStoreError):
            store.wait(keys, datetime.timedelta(seconds=self._answer_s))

    def _fail(self, message: str) -> typing.NoReturn:
        """Write the verdict and the watched thread's stack to this rank's log file, leave the
        verdict where the elastic agent reads this rank's error (its launcher prints it), or
        print it without one, and exit."""
        frame = sys._current_frames().get(self._watched)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        logs.to_file("error", "ranks stopped answering", error=message, stack=stack)
        if logs.AGENT_ERROR_FILE in os.environ:
            ErrorHandler().record_exception(HangError(message))
        else:
            print(f"HangError: {message}", file=sys.stderr, flush=True)
        os._exit(1)
