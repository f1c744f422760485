"""Where each rank's step time goes, and which rank is the straggler.

A :class:`StepTimer` splits each optimizer step into :data:`PHASES`: waiting for the data
(the loader's next batches, and their move to the device), the forward passes (with the loss
and the metrics), the backward passes (DDP's all-reduce included), the optimizer (clipping,
the update, the scheduler) and the time blocked in ups's own collectives (the step's
agreements, the sum of the ranks' counts). It adds no synchronisation: on CPU it reads
:func:`time.perf_counter` at the phase boundaries; on CUDA it records CUDA events there and
reads them only when a report takes the sums (one wait for the last event, every
``run.log_every`` steps).

The sums travel to every rank in the report's own all-reduce (each rank fills its row of a
``[world_size, phases]`` table, zeros elsewhere; the sum holds every rank's row), and
:func:`straggler` names the rank whose time outside communication (data, forward and
optimizer: a rank's backward pass holds DDP's all-reduce, in which every rank waits for the
slowest, so every rank's ends together) exceeds the ranks' median by more than
``run.straggler_threshold``.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Sequence

import attrs
import torch

PHASES = ("data", "forward", "backward", "optimizer", "collectives")
"""The phases of a step, in the order of a rank's row."""
DATA, FORWARD, BACKWARD, OPTIMIZER, COLLECTIVES = range(len(PHASES))
WORK = (DATA, FORWARD, OPTIMIZER)
"""The phases in which a rank waits for no other: what :func:`straggler` compares."""


class StepTimer:
    """One rank's time per phase, summed until :meth:`take`. In a loop of one's own: call
    :meth:`enter` with the phase the step is entering at each boundary, :meth:`stop` at the
    step's end, and :meth:`take` every so often."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._sums = [0.0] * len(PHASES)
        self._phase: int | None = None
        self._since = 0.0
        self._events: list[tuple[int | None, torch.cuda.Event]] = []

    def enter(self, phase: int | None) -> None:
        """The step enters ``phase`` now (``None``: it ended); the time since the last
        boundary counts to the phase it was in."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            self._events.append((phase, event))
            return
        now = time.perf_counter()
        if self._phase is not None:
            self._sums[self._phase] += now - self._since
        self._phase, self._since = phase, now

    def stop(self) -> None:
        """The step ended: nothing counts until the next :meth:`enter`."""
        self.enter(None)

    def take(self) -> list[float]:
        """The seconds in each phase since the last take (on CUDA: waits for the events
        recorded so far), and start summing again."""
        if self._events:
            events = self._events
            self._events = [events[-1]] if events[-1][0] is not None else []  # a phase open
            events[-1][1].synchronize()
            for (phase, start), (_, end) in itertools.pairwise(events):
                if phase is not None:
                    self._sums[phase] += start.elapsed_time(end) / 1000
        sums, self._sums = self._sums, [0.0] * len(PHASES)
        return sums


class NoTimer(StepTimer):
    """A timer that times nothing (``run.straggler_threshold: null``)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def enter(self, phase: int | None) -> None:
        """Nothing."""

    def stop(self) -> None:
        """Nothing."""


@attrs.frozen
class Straggler:
    """The rank whose time outside communication is the largest, above the median."""

    rank: int
    phase: str
    """The phase holding most of its excess over the ranks' medians."""
    seconds: float
    """Its time outside communication per step."""
    median: float
    """The ranks' median of that time."""


def straggler(rows: Sequence[Sequence[float]], threshold: float) -> Straggler | None:
    """The straggler among ``rows`` (each rank's seconds per phase), if the largest time
    outside communication exceeds the ranks' median by more than ``threshold`` (a fraction of
    the median); else ``None`` (and with one rank)."""
    work = [sum(row[p] for p in WORK) for row in rows]
    if len(work) < 2:
        return None
    median = statistics.median(work)
    rank = max(range(len(work)), key=work.__getitem__)
    if work[rank] <= median * (1 + threshold):
        return None
    phase = max(WORK, key=lambda p: rows[rank][p] - statistics.median(row[p] for row in rows))
    return Straggler(rank, PHASES[phase], work[rank], median)


def own_row(timer: StepTimer, rank: int, world_size: int, device: torch.device) -> torch.Tensor:
    """``timer``'s sums since the last take as this rank's row of a ``[world_size, phases]``
    table of zeros (flat, float64, on ``device``): summed over the ranks, every rank's row."""
    table = torch.zeros(world_size, len(PHASES), dtype=torch.float64)
    table[rank] = torch.tensor(timer.take(), dtype=torch.float64)
    return table.reshape(-1).to(device)
