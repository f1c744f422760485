"""Injectable faults: make a chosen rank fail at a chosen step, to test and rehearse recovery.

Set ``UPS_FAULTS`` in the environment of the ranks (every process a launcher starts inherits
it), as ``;``-separated ``KIND@RANK:STEP[,STEP...]`` items::

    UPS_FAULTS="oom@1:3;error@0:7,8;kill_save@1:6;kill_backward@0:4"

``oom`` raises :class:`torch.OutOfMemoryError` as CUDA does when memory runs out; ``error``
raises :class:`RuntimeError`; ``kill`` sends the rank SIGKILL (as ``kill -9`` or the kernel's
out-of-memory killer would); ``hang`` sleeps forever (a rank that stops answering). These fire
once, in the first forward pass of the model (inside DDP's forward, where real out-of-memory
errors happen) of the ``STEP``-th optimizer step the rank attempts, counting from 1, skipped steps
included. ``kill_backward`` sends the rank SIGKILL later in that step, inside its backward pass,
once the first module's backward is done (for a model whose gradients fill one DDP bucket,
before their all-reduce starts). ``kill_save`` sends the rank SIGKILL inside the checkpoint
save of optimizer step ``STEP``, at its first ``os.fsync`` there: its file written, the
checkpoint not committed. ``nan``, ``inf`` and ``spike`` corrupt, instead, the output of that
first forward pass (a tensor, or the tensors of a tuple, list or dict of them), for the training
guard (``training.guard``) to catch: ``nan`` multiplies it by NaN (the rank's loss is not
finite), ``inf`` leaves it as it is but makes the gradient flowing back into it infinite (the
loss finite, the gradients not), ``spike`` multiplies it by ``1e4`` (the gradient norm spikes).
``slow`` makes the rank a straggler: from step ``STEP`` on (its first step listed), it
sleeps :data:`SLOW_S` in the first forward pass of every step, for the straggler report
(``run.straggler_threshold``) to name. A fault that fires logs ``fault injected`` (its kind
and step) first (``slow``: once, at its first step).

Faults fire in the workers' first start only: a job its launcher restarted
(:attr:`~ups.core.dist._context.RunContext.restart_count` above 0) runs without them. This is a testing
hook, for rehearsing recovery; never set it in production.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import attrs
import structlog
import torch

from ..config._errors import UsageError

log = structlog.get_logger()

ENV = "UPS_FAULTS"
Kind = Literal[
    "oom", "error", "kill", "hang", "kill_backward", "kill_save", "nan", "inf", "spike", "slow"
]
KINDS: tuple[Kind, ...] = typing.get_args(Kind)
CORRUPTING: frozenset[Kind] = frozenset({"nan", "inf", "spike"})
"""The faults that corrupt a forward pass's output (:meth:`FaultInjector.corrupt`)."""
SPIKE = 1e4
"""What a ``spike`` fault multiplies the output by."""
SLOW_S = 0.05
"""How long a ``slow`` fault sleeps in each step's first forward pass."""


@attrs.frozen
class Fault:
    """One injected failure: ``kind`` on ``rank`` at each of ``steps``."""

    kind: Kind
    rank: int
    steps: frozenset[int]


def parse_faults(text: str) -> tuple[Fault, ...]:
    """Parse a ``UPS_FAULTS`` value.

    :raises UsageError: naming the item that is not ``KIND@RANK:STEP[,STEP...]``.
    """
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, _, rest = item.partition("@")
        rank, _, steps = rest.partition(":")
        try:
            if kind not in KINDS:
                raise ValueError
            fault = Fault(kind, int(rank), frozenset(int(s) for s in steps.split(",")))
        except ValueError:
            raise UsageError(
                f"{ENV}: bad item {item!r}; expected KIND@RANK:STEP[,STEP...] with KIND one of "
                f"{', '.join(KINDS)}, e.g. oom@1:3,4"
            ) from None
        faults.append(fault)
    return tuple(faults)


class FaultInjector:
    """This rank's share of the faults ``UPS_FAULTS`` asks for (none after a restart)."""

    def __init__(
        self, rank: int, env: Mapping[str, str] = os.environ, *, restart_count: int = 0
    ) -> None:
        self.rank = rank
        faults = parse_faults(env.get(ENV, "")) if restart_count == 0 else ()
        self._faults = [f for f in faults if f.rank == rank]
        self._fired: set[int] = set()
        self._corrupting: Kind | None = None
        slow = [min(f.steps) for f in self._faults if f.kind == "slow"]
        self._slow_from = min(slow) if slow else None
        self._slowed = 0
        """The last step a ``slow`` fault slept in."""

    def __bool__(self) -> bool:
        """Whether any fault is meant for this rank."""
        return bool(self._faults)

    def check(self, step: int) -> None:
        """Fire the fault meant for this rank's ``step``-th attempted step (raise, SIGKILL this
        process, sleep forever, have the step's backward pass SIGKILL it, or the forward pass's
        output corrupted by :meth:`corrupt`), the first time it is called for that step; with
        a ``slow`` fault from this step or before, sleep :data:`SLOW_S` first."""
        if self._slow_from is not None and step >= self._slow_from and step != self._slowed:
            if not self._slowed:
                log.warning("fault injected", kind="slow", step=step)
            self._slowed = step
            time.sleep(SLOW_S)
        if step in self._fired:
            return
        for fault in self._faults:
            if step in fault.steps and fault.kind not in ("kill_save", "slow"):
                self._fired.add(step)
                log.warning("fault injected", kind=fault.kind, step=step)
                where = f"injected by {ENV} on rank {self.rank} at step {step}"
                if fault.kind == "oom":
                    raise torch.OutOfMemoryError(f"CUDA out of memory ({where})")
                if fault.kind == "kill":
                    _kill()
                if fault.kind == "kill_backward":  # hooks the modules this forward pass calls
                    torch.nn.modules.module.register_module_full_backward_hook(lambda *_: _kill())
                    return
                if fault.kind in CORRUPTING:
                    self._corrupting = fault.kind
                    return
                while fault.kind == "hang":
                    time.sleep(3600)
                raise RuntimeError(f"injected error ({where})")

    def corrupt(self, output: Any) -> Any:
        """A forward pass's ``output`` as a ``nan``, ``inf`` or ``spike`` fault that :meth:`check`
        fired for this pass corrupts it (its floating-point tensors; in a tuple, list or dict
        too), or ``None`` (the output as it is: a forward hook's way) without one."""
        kind, self._corrupting = self._corrupting, None
        if kind is None:
            return None
        if kind == "nan":
            return _each_tensor(output, lambda t: t * float("nan"))
        if kind == "spike":
            return _each_tensor(output, lambda t: t * SPIKE)
        return _each_tensor(output, _InfiniteGradient.apply)

    @contextlib.contextmanager
    def saving(self, step: int) -> Iterator[None]:
        """Around the checkpoint save of optimizer step ``step``: with a ``kill_save`` fault for
        it, the rank SIGKILLs itself right after its first ``os.fsync`` in the save (its file
        written, the checkpoint not committed; a rank that writes nothing is not killed)."""
        if not any(f.kind == "kill_save" and step in f.steps for f in self._faults):
            yield
            return
        fsync = os.fsync

        def killing_fsync(fd: Any) -> None:
            fsync(fd)
            log.warning("fault injected", kind="kill_save", step=step)
            _kill()

        os.fsync = killing_fsync
        try:
            yield
        finally:
            os.fsync = fsync


class _InfiniteGradient(torch.autograd.Function):
    """The identity, whose backward pass gives an infinite gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("inf"))


def _each_tensor(value: Any, change: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``change`` applied to its floating-point tensors (``value`` itself, or
    the items of a tuple, list or dict)."""
    if isinstance(value, torch.Tensor):
        return change(value) if value.is_floating_point() else value
    if isinstance(value, tuple | list):
        return type(value)(_each_tensor(item, change) for item in value)
    if isinstance(value, dict):
        return {key: _each_tensor(item, change) for key, item in value.items()}
    return value


def _kill() -> None:
    """SIGKILL this process."""
    os.kill(os.getpid(), signal.SIGKILL)
