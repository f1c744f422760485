"""What every hook of this distribution shares: it counts the bytes it hands to collectives and,
when asked to profile, times each bucket's communication; the engine reports both per step.

A hook state derives from :class:`Traffic` and communicates through its :meth:`~Traffic.all_reduce`
and :meth:`~Traffic.all_gather`, which count what they are given; :func:`register` registers the
hook on a DDP model, wrapped in a timer when the options ask for ``profile``. The engine calls
:meth:`~Traffic.comm_metrics` at each report (every ``run.log_every`` steps).

Bytes are those handed to the collective by this rank: a ring all-reduce puts about twice that
on each rank's link, an all-gather ``world_size - 1`` times it; the ratio to plain all-reduce,
which the engine reports next to it, is what a hook saves.
"""

# No `from __future__ import annotations` here: register_comm_hook checks the hook's
# annotations against the objects dist.GradBucket and torch.futures.Future[torch.Tensor].

import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    # torch.distributed re-exports it only when distributed is available: invisible to mypy.
    from torch._C._distributed_c10d import GradBucket
else:
    GradBucket = dist.GradBucket


@attrs.frozen(kw_only=True)
class HookOptions:
    """The options every hook of ups-comm-hooks takes."""

    profile: bool = False
    """Time each bucket's communication and report it with its bytes, per step, in the metrics:
    ``comm_s`` (all buckets) and ``comm_b<i>_s`` / ``comm_b<i>_bytes`` (bucket ``i``). Costs one
    callback per bucket."""


class Traffic:
    """Counts, per bucket, the bytes a hook hands to collectives over its process group and,
    when profiling, the seconds each bucket's communication takes."""

    def __init__(self, process_group: dist.ProcessGroup, *, profile: bool = False) -> None:
        self.process_group = process_group
        """The group gradients are averaged over: the DDP model's own."""
        self.profile = profile
        """Whether :func:`register` times the hook."""
        self._bytes: defaultdict[int, int] = defaultdict(int)
        self._seconds: defaultdict[int, float] = defaultdict(float)
        self._started: dict[int, float] = {}

    def state_dict(self) -> dict[str, Any]:
        """What the hook keeps between steps, each rank its own, to checkpoint with the model
        (a hook with memory, such as PowerSGD's, extends it): nothing here, so that a loop
        saves and restores every hook alike."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from what :meth:`state_dict` returned: nothing to restore here.

        :raises ValueError: when ``state`` holds something (another hook's state).
        """
        if state:
            raise ValueError(
                f"this hook keeps no state between steps; the state given has {sorted(state)}: "
                "was it saved by another hook?"
            )

    @property
    def world_size(self) -> int:
        """The size of :attr:`process_group`."""
        return self.process_group.size()

    def count(self, bucket: int, tensor: torch.Tensor, numel: int | None = None) -> None:
        """Add ``tensor``'s bytes (or those of ``numel`` elements of its dtype) to those bucket
        ``bucket`` handed to a collective."""
        self._bytes[bucket] += (tensor.numel() if numel is None else numel) * tensor.element_size()

    def all_reduce(self, tensor: torch.Tensor, bucket: int) -> torch.futures.Future[torch.Tensor]:
        """Sum ``tensor`` over the group, in place, counted for ``bucket``; the future holds it."""
        self.count(bucket, tensor)
        work = dist.all_reduce(tensor, group=self.process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])  # type: ignore[no-any-return]

    def all_gather(self, tensor: torch.Tensor, bucket: int) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (of one shape on every rank), in rank order, counted for
        ``bucket``; returns when they are here."""
        self.count(bucket, tensor)
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor, group=self.process_group)
        return gathered

    def comm_metrics(self, steps: int) -> dict[str, float]:
        """Per step, over the ``steps`` optimizer steps since the last call: ``comm_bytes``
        (handed to collectives by this rank) and, when profiling, ``comm_s`` and each bucket's
        ``comm_b<i>_s`` and ``comm_b<i>_bytes``. Starts counting anew."""
        metrics = {"comm_bytes": sum(self._bytes.values()) / steps}
        if self.profile:
            metrics["comm_s"] = sum(self._seconds.values()) / steps
            for i in sorted(self._bytes.keys() | self._seconds.keys()):
                metrics[f"comm_b{i}_s"] = self._seconds[i] / steps
                metrics[f"comm_b{i}_bytes"] = self._bytes[i] / steps
        self._bytes.clear()
        self._seconds.clear()
        return metrics

    def _start(self, bucket: int) -> None:
        self._started[bucket] = time.perf_counter()

    def _stop(self, bucket: int) -> None:
        self._seconds[bucket] += time.perf_counter() - self._started.pop(bucket)


S = TypeVar("S", bound=Traffic)
Hook = Callable[[S, GradBucket], torch.futures.Future[torch.Tensor]]


def register(ddp: DistributedDataParallel, state: S, hook: "Hook[S]") -> S:
    """Register ``hook`` with ``state`` on ``ddp``, timed per bucket when ``state.profile``;
    return ``state``."""
    if not state.profile:
        ddp.register_comm_hook(state, hook)
        return state

    def profiled(state: S, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        index = bucket.index()
        state._start(index)

        def stop(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            state._stop(index)
            return fut.value()

        return hook(state, bucket).then(stop)

    ddp.register_comm_hook(state, profiled)
    return state
