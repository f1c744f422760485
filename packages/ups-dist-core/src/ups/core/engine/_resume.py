"""Saving the training state, and resuming from it: what a checkpoint holds, and how a run
continues where the newest one stopped (mid-epoch included), bitwise on CPU.

A checkpoint holds the replicated state (rank 0's is kept: model, optimizer, scheduler,
scaler, schedule, sampler position, step and epoch, what must not change across a resume) and
each rank's own (its generators, the comm hook's state, the plugins' states).
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import structlog
import torch
from pluggy import HookRelay
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ..checkpoint._model_state import load_model_state
from ..config._config import Config
from ..config._errors import ConfigError, UsageError
from ..dist._context import RunContext
from ..dist._rng import rng_state
from ..plugin._records import Checkpointer, Loaded
from ._ema import EMA
from ._faults import FaultInjector
from ._guard import Guard
from ._rundir import keep_until
from ._schedule import Schedule
from ._strategy import Strategy

log = structlog.get_logger()


@attrs.frozen(kw_only=True)
class Position:
    """Where the training stands: what the epoch loop needs to go on from a checkpoint."""

    step: int
    epoch: int
    """Epochs started."""
    epoch_left: int = 0
    """Batches of the current epoch not taken yet (``0``: the epoch is over)."""
    epoch_taken: int = 0
    """Batches of the current epoch taken (numbers the next batches' seeds)."""
    sampler: dict[str, Any] = attrs.field(factory=dict)
    """The sampler's state as of the last batch taken (``{}``: it has none)."""


@attrs.frozen(kw_only=True)
class InStage:
    """Which stage of a run of several (``stages``) a training is: checkpoints record it, so a
    resume goes on in the stage it stopped in (:mod:`ups.core.engine._stages`)."""

    index: int
    name: str
    start: int
    """The run's step the stage starts after: its steps are numbered on from it."""


@attrs.frozen(kw_only=True)
class Resumed:
    """What a resume hands the epoch loop beyond the restored objects."""

    position: Position
    replay: bool
    """Whether the interrupted epoch must skip its taken batches unread (a sampler without a
    state starts the epoch over), rather than go on from the sampler's state."""
    rng: dict[str, Any]
    """This rank's generators as they were, to set once the epoch is entered."""
    location: str
    """Where the checkpoint was read from."""


FORMAT = 1
"""The version of :class:`Saved`'s layout; raised when a field is added, renamed or removed."""


@attrs.frozen(kw_only=True)
class Saved:
    """The replicated state a checkpoint holds (rank 0's is kept), stored as a mapping of its
    fields plus ``format``: tensors, numbers, strings and containers only."""

    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    """``{}`` without a scheduler."""
    scaler: dict[str, Any]
    schedule: dict[str, Any]
    best: dict[int, float] = attrs.field(factory=dict)
    """Keep-best's kept checkpoints' steps and monitored values (``checkpoint.options.keep_best``);
    ``{}`` without it."""
    step: int
    epoch: int
    epoch_left: int
    epoch_taken: int
    sampler: dict[str, Any]
    world_size: int
    """The number of ranks that saved it."""
    identity: dict[str, Any]
    """What a resume must find unchanged (:meth:`TrainingState._identity`)."""
    rng: dict[str, Any]
    """Rank 0's generators, for a resume on another number of ranks."""
    plugins: dict[str, Any]
    """Rank 0's plugins' states, for a resume on another number of ranks."""
    config_digest: str
    versions: dict[str, str]
    """torch's and the ``ups-*`` distributions' versions."""
    ema: dict[str, Any] = attrs.field(factory=dict)
    """The EMA of the weights (:meth:`EMA.state_dict <ups.core.EMA.state_dict>`): its
    ``model`` holds the averages by the model's names; ``{}`` without one (and in a checkpoint
    saved before it was kept)."""
    stage: int = 0
    """The index of the stage that saved it (``stages``; ``0`` for a run without)."""
    guard: dict[str, Any] = attrs.field(factory=dict)
    """The training guard's state (:meth:`Guard.state <ups.core.engine._guard.Guard.state>`
    as ``{"state": [...]}``: its running average, and the steps left of an LR cut); ``{}``
    without a guard."""

    def to_dict(self) -> dict[str, Any]:
        """The mapping a checkpointer stores."""
        return {"format": FORMAT, **attrs.asdict(self, recurse=False)}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], location: str) -> Saved:
        """Read back what :meth:`to_dict` stored.

        :raises UsageError: naming ``location`` and the versions that saved it, for a
            checkpoint of another format.
        """
        found = state.get("format")
        names = [f.name for f in attrs.fields(cls)]
        needed = [f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING]
        if found != FORMAT or any(name not in state for name in needed):
            versions = state.get("versions") or {}
            by = ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) or "an older ups"
            raise UsageError(
                f"checkpoint {location}: its training state has format {found!r} (saved by "
                f"{by}), this ups-dist-core reads format {FORMAT}; resume it with the version "
                "that saved it, or start afresh (checkpoint.resume: none)"
            )
        return cls(**{name: state[name] for name in names if name in state})


@attrs.frozen(kw_only=True)
class RankSaved:
    """What each rank saves of its own."""

    rng: dict[str, Any]
    """The rank's generators."""
    plugins: dict[str, Any]
    """The plugins' states, by key."""
    comm_hook: Any = None
    """The comm hook's ``state_dict()``, where it has one."""
    comm_hook_name: str | None = None
    """The comm hook that saved ``comm_hook``."""

    def to_dict(self) -> dict[str, Any]:
        """The mapping a checkpointer stores."""
        return attrs.asdict(self, recurse=False)

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> RankSaved:
        """Read back what :meth:`to_dict` stored."""
        return cls(**{f.name: state[f.name] for f in attrs.fields(cls) if f.name in state})


@attrs.define(kw_only=True)
class TrainingState:
    """The objects a checkpoint saves and a resume restores, and how."""

    config: Config
    ctx: RunContext
    hook: HookRelay
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler | None
    scaler: torch.amp.GradScaler
    schedule: Schedule
    best: dict[int, float] = attrs.field(factory=dict)
    """Keep-best's kept checkpoints, ``{step: monitored value}``: saved and restored in place."""
    sampler: Any
    dataset: Any
    checkpointer: Checkpointer
    comm_state: object | None
    strategy: Strategy
    """What gathers the full model and optimizer state to save, and places it back."""
    faults: FaultInjector
    ema: EMA | None = None
    stage: int = 0
    """The index of the run's stage this training is (``stages``; ``0`` without)."""
    guard: Guard | None = None
    """The training guard, whose running average and LR cut a checkpoint keeps."""

    def save(self, position: Position, metrics: Mapping[str, float] | None = None) -> str:
        """Save a checkpoint at ``position`` (for the evaluated ``metrics``: keep-best's
        best); return where it went."""
        step = position.step
        state_dict = getattr(self.comm_state, "state_dict", None)
        own = RankSaved(
            rng=rng_state(self.ctx.device),
            plugins=self.plugin_states(),
            comm_hook=state_dict() if state_dict is not None else None,
            comm_hook_name=self.config.comm_hook.name if state_dict is not None else None,
        )
        saved = Saved(
            model=self.strategy.gathered(self.model.state_dict()),
            optimizer=self.strategy.optimizer_state(self.optimizer),
            scheduler=self.scheduler.state_dict() if self.scheduler is not None else {},
            scaler=self.scaler.state_dict(),
            schedule=self.schedule.state_dict(),
            best=dict(self.best),
            step=step,
            epoch=position.epoch,
            epoch_left=position.epoch_left,
            epoch_taken=position.epoch_taken,
            sampler=position.sampler,
            world_size=self.ctx.world_size,
            identity=self._identity(),
            rng=own.rng,
            plugins=own.plugins,
            config_digest=self.config.digest(),
            versions=dict(_versions()),
            ema={"model": self.strategy.gathered(self.ema.averaged())}
            if self.ema is not None
            else {},
            stage=self.stage,
            guard={"state": list(self.guard.state())} if self.guard is not None else {},
        )
        # metrics only when given: a backend written before keep_best takes no such argument
        extra = {"metrics": metrics} if metrics is not None else {}
        with self.faults.saving(step):
            location = self.checkpointer.save(
                saved.to_dict(), step=step, rank_state=own.to_dict(), **extra
            )
        self.hook.ups_checkpoint_saved(ctx=self.ctx, step=step, location=location)
        log.info("checkpoint saved", step=step, location=location)
        return location

    def resume(self) -> Resumed | None:
        """Restore the newest checkpoint, if any: the model, optimizer, scheduler, scaler,
        schedule, sampler, the comm hook's and plugins' states; return where to go on.

        Rank 0 first drops the reports after the checkpoint from ``metrics.jsonl`` (all of
        them without a checkpoint): the run reports those steps again, and the plugins
        restored (:func:`~ups.core.plugin.hookspecs.ups_checkpoint_restore`) read one history."""
        loaded = self.checkpointer.load_latest()
        if loaded is None:
            log.info("no checkpoint to resume from: starting afresh")
            self.supersede_after(0)
            return None
        state = Saved.from_dict(loaded.state, loaded.location)
        if state.stage < self.stage:  # the stage before's last: this stage starts after it
            log.info(f"stage {self.stage} starts after the checkpoint of step {loaded.step}")
            self.supersede_after(loaded.step)
            return None
        if state.stage > self.stage:
            raise UsageError(
                f"checkpoint {loaded.location} was saved by stage {state.stage}, after stage "
                f"{self.stage}, whose weights are not kept: start afresh (checkpoint.resume: none)"
            )
        self._check_identity(loaded.step, state.identity)
        self.supersede_after(loaded.step)
        load_model_state(
            self.model,
            state.model,
            key="checkpoint.resume",
            source=f"the checkpoint {loaded.location}",
            advice="start afresh (checkpoint.resume: none) or in another run folder (run.name)",
            place=self.strategy.scattered,
        )
        self.strategy.load_optimizer_state(self.optimizer, state.optimizer)
        self.best.clear()  # keep-best's, in place: the run holds it
        self.best.update(state.best)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state.scheduler)
        self.scaler.load_state_dict(state.scaler)
        self.schedule.load_state_dict(state.schedule)
        self._restore_ema(state.ema)
        if self.guard is not None and state.guard:
            average, accepted, cut_left = state.guard["state"]
            self.guard.load_state((float(average), int(accepted), int(cut_left)))
        load = getattr(self.sampler, "load_state_dict", None) if state.sampler else None
        if load is not None:
            load(state.sampler)
        own = self._restore_own(loaded, state)
        left = state.epoch_left
        replay = bool(left) and load is None
        taken = state.epoch_taken if left else 0
        if replay and state.world_size != self.ctx.world_size:
            log.warning(
                "the sampler has no state to deal the rest of the epoch to another number "
                "of ranks: the epoch starts over",
                saved_world_size=state.world_size,
            )
            replay, taken = False, 0
        changed = state.config_digest != self.config.digest()
        log.info("resumed", step=loaded.step, epoch=state.epoch, config_changed=changed)
        position = Position(
            step=state.step,
            epoch=state.epoch - 1 if left else state.epoch,  # the loop enters it again
            epoch_left=left,
            epoch_taken=taken,
        )
        return Resumed(
            position=position, replay=replay, rng=(own or state).rng, location=loaded.location
        )

    def _restore_ema(self, saved: dict[str, Any]) -> None:
        """Restore the EMA, if the run keeps one: the checkpoint's, or afresh from the resumed
        weights when the checkpoint has none."""
        if self.ema is None:
            return
        if saved:
            self.ema.load_state_dict(
                {**saved, "model": self.strategy.scattered(saved["model"], self.ema.averaged())}
            )
            return
        if self.ctx.is_main:
            log.warning("the checkpoint has no EMA of the weights: it starts from the resumed ones")
        self.ema.reset()

    def supersede_after(self, step: int) -> None:
        """On rank 0, drop the reports after ``step`` from ``metrics.jsonl``
        (:func:`~ups.core.engine._rundir.keep_until`)."""
        if self.ctx.is_main:
            dropped = keep_until(self.config.run_dir, step)
            if dropped:
                log.info(f"metrics.jsonl: {dropped} lines after step {step} dropped", step=step)

    def plugin_states(self) -> dict[str, Any]:
        """Every plugin's :func:`~ups.core.plugin.hookspecs.ups_checkpoint_state`, by key."""
        states: dict[str, Any] = {}
        for returned in self.hook.ups_checkpoint_state(ctx=self.ctx):
            for key, value in (returned or {}).items():
                if key in states:
                    raise UsageError(f"two plugins save checkpoint state under the key {key!r}")
                states[key] = value
        return states

    def _restore_own(self, loaded: Loaded, state: Saved) -> RankSaved | None:
        """Restore the comm hook's state (this rank's) and the plugins' states (this rank's,
        else rank 0's); this rank's saved state, if the checkpoint has one."""
        own = RankSaved.from_dict(loaded.rank_state) if loaded.rank_state is not None else None
        if own is None and self.ctx.is_main:
            log.warning(
                "checkpoint saved by another number of ranks: each rank's generators start "
                "from rank 0's and the comm hook's state starts afresh",
                saved_world_size=state.world_size,
            )
        load = getattr(self.comm_state, "load_state_dict", None)
        if own is not None and load is not None and own.comm_hook_name is not None:
            self._restore_comm_hook(load, own)
        self.hook.ups_checkpoint_restore(ctx=self.ctx, state=(own or state).plugins)
        return own

    def _restore_comm_hook(self, load: Callable[[Any], None], own: RankSaved) -> None:
        """Hand the comm hook its saved state, if the hook that saved it is this run's; else
        warn that its state starts afresh.

        :raises ConfigError: naming ``comm_hook.options`` when the hook refuses the state (saved
            with options that shape it otherwise, such as another PowerSGD rank).
        """
        name = self.config.comm_hook.name
        saved_by = own.comm_hook_name
        if saved_by != name:
            if self.ctx.is_main:
                log.warning(
                    f"the checkpoint's comm hook state was saved by {saved_by!r}, not by {name!r}"
                    " as now: its state starts afresh"
                )
            return
        try:
            load(own.comm_hook)
        except ValueError as error:
            raise ConfigError(
                "comm_hook.options", f"cannot resume the checkpoint: {error}"
            ) from None

    def _identity(self) -> dict[str, Any]:
        """What a resume must find unchanged, unless ``checkpoint.allow_changed`` says. The
        dataset is known by its size and its tasks' sizes, and by its own ``fingerprint``
        (a string attribute, as Hugging Face datasets have ``_fingerprint``) where it has one."""
        parts = getattr(self.dataset, "datasets", None)
        sizes = [len(part) for part in parts] if parts else [len(self.dataset)]
        own = getattr(self.dataset, "fingerprint", getattr(self.dataset, "_fingerprint", None))
        return {
            "seed": self.config.run.seed,
            "accumulation_steps": self.config.training.accumulation_steps,
            "dataset": [*sizes, own] if isinstance(own, str) else sizes,
        }

    def _check_identity(self, step: int, saved: dict[str, Any]) -> None:
        """Refuse to continue a run whose seed, accumulation or data changed, unless allowed.

        :raises ConfigError: on every rank (each reads the same checkpoint), naming the key.
        """
        allowed = self.config.checkpoint.allow_changed
        for key, value in self._identity().items():
            if key in saved and saved[key] != value and key not in allowed:
                raise ConfigError(
                    "checkpoint.resume",
                    f"the checkpoint of step {step} was saved with {key} {saved[key]!r}, this "
                    f"run has {value!r}; start afresh (checkpoint.resume: none), or accept it "
                    f"with --allow-changed {key}",
                )


@functools.cache
def _versions() -> dict[str, str]:
    """The versions of torch and of the ups distributions installed, as checkpoints record."""
    found = {"torch": str(torch.__version__)}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name.startswith("ups-"):
            found[name] = dist.version
    return found
