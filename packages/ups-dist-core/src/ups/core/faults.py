"""Injectable faults: make a chosen rank fail at a chosen step, to test and rehearse recovery.

Set ``UPS_FAULTS`` in the environment of the ranks (every process a launcher starts inherits
it), as ``;``-separated ``KIND@RANK:STEP[,STEP...]`` items::

    UPS_FAULTS="oom@1:3;error@0:7,8"

``oom`` raises :class:`torch.OutOfMemoryError` as CUDA does when memory runs out; ``error``
raises :class:`RuntimeError`. A fault fires once, in the first forward pass of the model (inside
DDP's forward, where real out-of-memory errors happen) of the ``STEP``-th optimizer step the
rank attempts, counting from 1, skipped steps included.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

import attrs
import torch

from .errors import UsageError

ENV = "UPS_FAULTS"
KINDS = ("oom", "error")


@attrs.frozen
class Fault:
    """One injected failure: ``kind`` on ``rank`` at each of ``steps``."""

    kind: Literal["oom", "error"]
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
            fault = Fault(kind, int(rank), frozenset(int(s) for s in steps.split(",")))  # type: ignore[arg-type]
        except ValueError:
            raise UsageError(
                f"{ENV}: bad item {item!r}; expected KIND@RANK:STEP[,STEP...] with KIND one of "
                f"{', '.join(KINDS)}, e.g. oom@1:3,4"
            ) from None
        faults.append(fault)
    return tuple(faults)


class FaultInjector:
    """This rank's share of the faults ``UPS_FAULTS`` asks for."""

    def __init__(self, rank: int, env: Mapping[str, str] = os.environ) -> None:
        self.rank = rank
        self._faults = [f for f in parse_faults(env.get(ENV, "")) if f.rank == rank]
        self._fired: set[int] = set()

    def __bool__(self) -> bool:
        """Whether any fault is meant for this rank."""
        return bool(self._faults)

    def check(self, step: int) -> None:
        """Raise the fault meant for this rank's ``step``-th attempted step, the first time
        it is called for that step."""
        if step in self._fired:
            return
        for fault in self._faults:
            if step in fault.steps:
                self._fired.add(step)
                where = f"injected by {ENV} on rank {self.rank} at step {step}"
                if fault.kind == "oom":
                    raise torch.OutOfMemoryError(f"CUDA out of memory ({where})")
                raise RuntimeError(f"injected error ({where})")
