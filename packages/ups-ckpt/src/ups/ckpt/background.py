"""Saving in the background: stage on the training thread, write on another, one at a time.

:class:`InBackground` wraps a backend's synchronous checkpointer. ``save`` waits for the save
before it (one in flight), copies the state (tensors to new CPU memory, so training may change
its own at once), hands the copy to a writer thread and returns: training stalls for the copy
only. The writer calls the wrapped checkpointer, whose collectives (agreeing on failures,
committing) run on a process group of their own, made for it, so they can never interleave
with, or deadlock against, the training's collectives on the default group. A failed save is
raised, on every rank, by the next ``save``, ``load_latest`` or ``wait``.
"""

from __future__ import annotations

import concurrent.futures
import datetime
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import structlog
import torch
import torch.distributed as dist

from ups.core import Checkpointer, Loaded, RunContext

log = structlog.get_logger()


class Locating(Checkpointer, Protocol):
    """A synchronous checkpointer that says in advance where a save will go."""

    def location(self, step: int) -> str:
        """Where checkpoint ``step`` will be, once committed."""
        ...


class InBackground:
    """Runs a :class:`Locating` checkpointer's saves on a writer thread (see the module doc).

    :param build: builds the wrapped checkpointer, given the process group it is to use.
    """

    def __init__(
        self, *, ctx: RunContext, build: Callable[[dist.ProcessGroup | None], Locating]
    ) -> None:
        group = None
        if ctx.distributed:  # a collective: every rank builds its checkpointer together
            timeout = datetime.timedelta(seconds=ctx.timeout_s)
            group = dist.new_group(backend="gloo", timeout=timeout)
        self.inner = build(group)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ups-ckpt")
        self._in_flight: concurrent.futures.Future[str] | None = None

    def save(self, state: Mapping[str, Any], *, step: int, rank_state: Mapping[str, Any]) -> str:
        """Wait for the save before, copy the states, start writing them; return where the
        checkpoint will be once committed."""
        self.wait()
        staged, own = stage(state), stage(rank_state)
        self._in_flight = self._writer.submit(self.inner.save, staged, step=step, rank_state=own)
        return self.inner.location(step)

    def load_latest(self) -> Loaded | None:
        self.wait()
        return self.inner.load_latest()

    def wait(self) -> None:
        """Return once the save in flight, if any, committed; re-raise its failure."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()


def stage(obj: Any) -> Any:
    """A copy of a state that training cannot change: every tensor copied to new CPU memory,
    the containers rebuilt, other values (numbers, strings) shared."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):  # an OrderedDict (a module's state dict) stays one
        copied = {k: stage(v) for k, v in obj.items()}
        return copied if type(obj) is dict else type(obj)(copied)
    if isinstance(obj, (list, tuple)):
        return type(obj)(stage(v) for v in obj)
    return obj
