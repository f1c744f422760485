"""The guard's rollback (``training.guard.action: rollback``): each rank's in-memory copy of
what a checkpoint holds, and putting it back.

A snapshot is this rank's own copies, taken with no collective: the model's ``state_dict()``
(under a sharded strategy, this rank's shards), the optimizer state this rank holds (the
strategy's :meth:`~ups.core.engine._strategy.Strategy.own_optimizer_state`: under ``zero``,
its shard), the scheduler, the scaler, the schedule, the position in the data, the comm
hook's and the plugins' states, the generators, the EMA, and the loss window since the last
report. Every rank takes one at the
same steps and restores it together, so the ranks stay one run.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs
import torch

from ..dist._rng import rng_state
from ..observe._metrics import LossWindow
from ..observe._step_metrics import UserMetrics
from ._resume import Position, Resumed, TrainingState


@attrs.frozen(kw_only=True)
class Snapshot:
    """This rank's training state at a step, in memory (nothing here is shared with the live
    objects)."""

    position: Position
    """Where the run stood, as the loop keeps it (``epoch``: epochs started)."""
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any]
    schedule: dict[str, Any]
    ema: dict[str, torch.Tensor]
    comm_hook: Any
    plugins: dict[str, Any]
    rng: dict[str, Any]
    window: dict[str, Any]
    metrics: dict[str, torch.Tensor]
    """The user metrics' sums since the last report."""
    guard: tuple[float, int, int]


def _cloned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in tensors.items()}


def take(
    state: TrainingState,
    position: Position,
    window: LossWindow,
    metrics: UserMetrics,
    guard: tuple[float, int, int],
) -> Snapshot:
    """This rank's snapshot at ``position``: ``state``'s objects copied, ``window`` (a host
    sync), the user ``metrics``' sums and the guard's ``guard`` state with them."""
    comm = getattr(state.comm_state, "state_dict", None)
    return Snapshot(
        position=position,
        model=_cloned(state.model.state_dict()),
        optimizer=state.strategy.own_optimizer_state(state.optimizer),
        scheduler=copy.deepcopy(state.scheduler.state_dict()) if state.scheduler else {},
        scaler=state.scaler.state_dict(),
        schedule=copy.deepcopy(state.schedule.state_dict()),
        ema=_cloned(state.ema.averaged()) if state.ema is not None else {},
        comm_hook=copy.deepcopy(comm()) if comm is not None else None,
        plugins=copy.deepcopy(state.plugin_states()),
        rng=rng_state(state.ctx.device),
        window=window.state_dict(),
        metrics=metrics.state_dict(),
        guard=guard,
    )


def restore(
    state: TrainingState, snapshot: Snapshot, window: LossWindow, metrics: UserMetrics
) -> Resumed:
    """Put ``snapshot`` back into ``state``'s objects, ``window`` and ``metrics`` (copies again: the
    snapshot stays as it was, for another rollback) and tell the loop where to go on, as a
    resume does (the epoch entered again at the snapshot's place, the generators set then)."""
    state.model.load_state_dict(_cloned(snapshot.model))
    state.strategy.load_own_optimizer_state(state.optimizer, snapshot.optimizer)
    state.optimizer.zero_grad(set_to_none=True)
    if state.scheduler is not None:
        state.scheduler.load_state_dict(copy.deepcopy(snapshot.scheduler))
    state.scaler.load_state_dict(snapshot.scaler)
    state.schedule.load_state_dict(copy.deepcopy(snapshot.schedule))
    if state.ema is not None:
        state.ema.load_state_dict({"model": _cloned(snapshot.ema)})
    load = getattr(state.comm_state, "load_state_dict", None)
    if load is not None and snapshot.comm_hook is not None:
        load(copy.deepcopy(snapshot.comm_hook))
    state.hook.ups_checkpoint_restore(ctx=state.ctx, state=copy.deepcopy(snapshot.plugins))
    window.load_state_dict(snapshot.window)
    metrics.load_state_dict(snapshot.metrics)
    at = snapshot.position
    load_sampler = getattr(state.sampler, "load_state_dict", None) if at.sampler else None
    if load_sampler is not None:
        load_sampler(at.sampler)
    left = at.epoch_left
    return Resumed(
        position=Position(
            step=at.step,
            epoch=at.epoch - 1 if left else at.epoch,  # the loop enters it again
            epoch_left=left,
            epoch_taken=at.epoch_taken if left else 0,
        ),
        replay=bool(left) and load_sampler is None,
        rng=snapshot.rng,
        location=f"the snapshot of step {at.step}",
    )
