"""Saving in the background: stage on the training thread, write on another, one at a time.

:class:`InBackground` wraps a backend's synchronous checkpointer. ``save`` waits for the save
before it (one in flight), copies the state (tensors to CPU buffers kept from one save to the
next, :class:`Stager`, so training may change its own at once), hands the copy to a writer
thread and returns: training stalls for the copy only. The writer calls the wrapped checkpointer, whose collectives (agreeing on failures,
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
from ups.core.config import saved_rank_state

log = structlog.get_logger()


class Locating(Checkpointer, Protocol):
    """A synchronous checkpointer that says in advance where a save will go."""

    def location(self, step: int) -> str:
        """Where checkpoint ``step`` will be, once committed."""
        ...

    def load_best(self) -> Loaded | None:
        """The checkpoint keep-best's ``best`` pointer names, or ``None``."""
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
        self._stager = Stager()
        self._in_flight: concurrent.futures.Future[str] | None = None

    def save(
        self,
        state: Mapping[str, Any],
        *,
        step: int,
        rank_state: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> str:
        """Wait for the save before, copy the states, start writing them (and ``metrics``,
        recorded with them); return where the checkpoint will be once committed.

        :raises ArgumentTypeError: (a ``TypeError``) at once, for a ``state`` or ``rank_state``
            that is not a mapping (``None``: no rank state).
        """
        rank_state = saved_rank_state(state, rank_state)
        self.wait()
        staged = self._stager.stage({"state": state, "rank_state": rank_state})
        self._in_flight = self._writer.submit(
            self.inner.save,
            staged["state"],
            step=step,
            rank_state=staged["rank_state"],
            metrics=metrics,
        )
        return self.inner.location(step)

    def load_latest(self) -> Loaded | None:
        self.wait()
        return self.inner.load_latest()

    def load_best(self) -> Loaded | None:
        """Wait for the save in flight; the checkpoint ``best`` names (keep-best), or ``None``."""
        self.wait()
        return self.inner.load_best()

    def wait(self) -> None:
        """Return once the save in flight, if any, committed; re-raise its failure."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()


class Stager:
    """Copies states into CPU buffers it keeps from one save to the next.

    The first copy of a state goes to new memory, and most of its cost is the kernel mapping
    that memory in; every later copy of a state of the same shapes goes into the same buffers,
    already mapped: a plain memory copy (pinned memory for CUDA tensors, so that the copy from
    the device is a DMA). The price is one copy of the state in host memory for the whole run,
    as every background checkpointer pays. A buffer is reused only once the save that read it
    has finished (:class:`InBackground` waits for it before staging again).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, obj: Any) -> Any:
        """A copy of ``obj`` that training cannot change: every tensor copied to CPU memory
        of the stager's, the containers rebuilt, other values (numbers, strings) shared."""
        used: set[str] = set()
        staged = self._copy(obj, "", used)
        for path in self._buffers.keys() - used:  # states whose keys changed
            del self._buffers[path]
        return staged

    def _copy(self, obj: Any, path: str, used: set[str]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj.detach(), path, used)
        if isinstance(obj, dict):  # an OrderedDict (a module's state dict) stays one
            copied = {k: self._copy(v, f"{path}/{k!r}", used) for k, v in obj.items()}
            return copied if type(obj) is dict else type(obj)(copied)
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, f"{path}/{i}", used) for i, v in enumerate(obj))
        return obj

    def _tensor(self, tensor: torch.Tensor, path: str, used: set[str]) -> torch.Tensor:
        if tensor.layout != torch.strided:  # sparse and the like: a copy of their own
            return tensor.to("cpu", copy=True)
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[path] = buffer
        used.add(path)
        return buffer.copy_(tensor)


def stage(obj: Any) -> Any:
    """A copy of a state that training cannot change, in new CPU memory (see :class:`Stager`)."""
    return Stager().stage(obj)
