"""The records registration hooks return, and the interfaces their factories build.

Each family's hook returns an iterable of one record type. A record names its plugin (a short,
lowercase, unique name the config selects it by), the factory the engine calls, and the attrs
class its ``options`` mapping in the config is checked against. The factory and the options
class may be named with :func:`ups.core.imported` (``"package.module:name"``), so that
listing the records (``ups plugins``) does not import the modules they need (torch).
"""

from __future__ import annotations

import argparse
import enum
import re
from collections.abc import Iterable, Mapping, Sized
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import attrs

from .._lazy import resolved
from ..config._arguments import check_type, choice
from ..config._structure import structure

if TYPE_CHECKING:  # annotations only: describing a plugin imports no torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import Sampler

    from ..config._config import Config
    from ..dist._context import RunContext
    from ..engine._strategy import Strategy

_NAME = re.compile(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")


def _valid_name(_instance: object, _attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(
            f"plugin name {value!r} is not allowed: use lowercase letters, digits, '-' and '_', "
            "starting with a letter"
        )


@attrs.frozen
class NoOptions:
    """The options class of a plugin that takes none: any key in ``options`` is an error."""


@attrs.frozen(kw_only=True)
class PluginRecord:
    """What every registration record holds."""

    name: str = attrs.field(validator=_valid_name)
    """The name the config selects the plugin by, e.g. ``sampler: {name: torch}``."""
    options: type = NoOptions
    """An attrs class; the config's ``options`` mapping is checked against and built into it."""
    description: str = ""
    """One line shown by ``ups plugins``."""

    def loaded(self, *, factory: bool = True) -> Any:
        """This record with its ``factory`` (unless ``factory=False``) and ``options``
        imported, where they are named with :func:`ups.core.imported` (what building from it
        needs; listing it does not, checking a config's options needs the options only)."""
        fields = attrs.fields_dict(type(self))
        names = ("factory", "options") if factory else ("options",)
        lazy = {f: resolved(getattr(self, f)) for f in names if f in fields}
        return attrs.evolve(self, **lazy)


R = TypeVar("R", bound=PluginRecord)


def chosen(
    records: Iterable[R], name: str, *, ctx: object, options: object = None
) -> tuple[R, Any]:
    """For a loop of one's own, what the engine does for a config's plugin section: the record
    of ``records`` (a plugin's own, its registration hook's) called ``name``, its factory and
    options imported, and ``options`` (a mapping, an instance of its options class, or
    ``None`` for the defaults) built into its options class; ``ctx`` checked to be a
    :class:`~ups.core.RunContext`.

    :raises ConfigError: naming the argument: an unknown ``name`` (with the closest one), an
        unknown option or one of the wrong type; for an argument of the wrong type, an
        :class:`~ups.core.config.ArgumentTypeError` (a ``TypeError`` too).
    """
    from ..dist._context import RunContext  # here: describing a plugin imports no torch

    by_name = {record.name: record for record in records}
    record: R = by_name[choice("name", name, sorted(by_name))].loaded()
    check_type("ctx", ctx, RunContext, "a RunContext (from ups.core.distributed_session)")
    if not isinstance(options, record.options):
        options = structure(record.options, options, "options")
    return record, options


# ---------------------------------------------------------------------------------------------
# Samplers


class SamplerFactory(Protocol):
    """Builds the training sampler for this rank."""

    def __call__(
        self, dataset: Sized, *, ctx: RunContext, seed: int, options: Any
    ) -> Sampler[int]: ...


@attrs.frozen(kw_only=True)
class SamplerPlugin(PluginRecord):
    """A distributed sampler. ``set_epoch(epoch)``, if the sampler has it, is called every epoch."""

    factory: SamplerFactory
    multi_task: bool = False
    """Whether it balances the tasks of multi-task data (``data.tasks``) across ranks."""
    exact: bool = False
    """Whether it gives every sample to exactly one rank, none padded, so that the ranks'
    shares may differ in length: an evaluation sampler (``eval.sampler``), not a training one
    (DDP needs every rank to take the same number of steps)."""
    even: bool = False
    """Whether every rank gets the same number of samples in an epoch, the last batch included
    (padding or dropping to a multiple of the world size, as torch's ``DistributedSampler``
    does). The engine then knows a step's sample count over all ranks without a collective;
    otherwise it sums the ranks' counts once per optimizer step, so that every sample of the
    step weighs the same whatever its rank."""
    world_invariant: bool = False
    """Whether the samples of global step ``t`` at ``W`` ranks of batch ``b`` are the samples
    of step ``t`` at one process of batch ``W·b`` (their order within a rank's batch, and the
    padding at an epoch's end, aside): then ``W`` ranks train exactly as one process does.
    ``ups validate`` warns when the chosen training sampler does not declare it."""


# ---------------------------------------------------------------------------------------------
# Communication hooks


class CommHookFactory(Protocol):
    """Registers a DDP communication hook on ``ddp`` and returns the hook's state (or ``None``).

    The engine uses what the state has of: ``state_dict()`` and ``load_state_dict(state)``
    (saved with each rank's checkpoint, restored before the first step of a resumed run), and
    ``comm_metrics(steps) -> Mapping[str, float]``, the hook's metrics per step over the
    ``steps`` optimizer steps since the last call (``comm_bytes``: bytes handed to collectives),
    merged into each report.
    """

    def __call__(
        self, ddp: DistributedDataParallel, *, ctx: RunContext, options: Any
    ) -> object | None: ...


@attrs.frozen(kw_only=True)
class CommHookPlugin(PluginRecord):
    """A DDP communication hook (gradient compression, profiling, ...)."""

    factory: CommHookFactory


# ---------------------------------------------------------------------------------------------
# Strategies


class StrategyFactory(Protocol):
    """Builds this rank's :class:`~ups.core.Strategy`, before the model is wrapped."""

    def __call__(self, *, ctx: RunContext, config: Config, options: Any) -> Strategy: ...


@attrs.frozen(kw_only=True)
class StrategyPlugin(PluginRecord):
    """How a run spreads its model over the ranks (``strategy: {name: ...}``): ``ddp`` (built
    in), ups-fsdp's ``zero`` and ``fsdp``."""

    factory: StrategyFactory
    comm_hooks: bool = True
    """Whether DDP communication hooks apply: choosing one (``comm_hook``) under a strategy
    that says not is a usage error, naming :attr:`instead`."""
    instead: str = ""
    """What to use instead of a comm hook, as that error says (an option of the strategy)."""
    local_passes: bool = True
    """Whether a micro-batch can go forward and backward on one rank with no collective: what
    agreeing on out-of-memory (``training.skip_oom``) and ``ups tune``'s one-rank trials need.
    Without, ``skip_oom: true`` is a usage error and ``auto`` is off."""


# ---------------------------------------------------------------------------------------------
# Checkpoint backends


@attrs.frozen(kw_only=True)
class Loaded:
    """A checkpoint as :meth:`Checkpointer.load_latest` hands it to one rank."""

    step: int
    """The optimizer step it was saved at."""
    state: dict[str, Any]
    """The replicated state, as rank 0 saved it."""
    rank_state: dict[str, Any] | None
    """What this rank saved of its own, or ``None`` when the checkpoint was saved by another
    number of ranks (there is then no state that is this rank's)."""
    location: str
    """Where it was read from (a path or URL)."""


class Checkpointer(Protocol):
    """Saves and loads training state. Every method is a collective: every rank calls it."""

    def save(
        self,
        state: Mapping[str, Any],
        *,
        step: int,
        rank_state: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> str:
        """Save ``state`` (replicated: rank 0's is kept) and each rank's own ``rank_state``
        (``None``: none) as checkpoint ``step``; return where it goes, the same on every rank.
        ``metrics``: the evaluated values the checkpoint is saved for, passed only with the
        backend's ``keep_best`` option (the commit protocol records and ranks them).

        A backend that writes in the background returns once the state is staged (copied),
        before it is committed; its failure is raised by the next ``save`` or ``wait``.
        """
        ...

    def load_latest(self) -> Loaded | None:
        """The newest checkpoint that verifies, or ``None`` if there is none."""
        ...

    def wait(self) -> None:
        """Return once no save is in flight (every save returned is committed); raise, on
        every rank, if one failed."""
        ...


class CheckpointFactory(Protocol):
    """Builds a checkpointer writing under ``directory``."""

    def __call__(self, *, ctx: RunContext, directory: Path, options: Any) -> Checkpointer: ...


class CheckpointProbe(Protocol):
    """Checks, before any rank starts, that checkpoints of the run whose folder is
    ``directory`` can be written where the backend built with ``options`` keeps them: a probe
    file or object written there and removed, nothing left behind (no folder made).
    ``ups validate`` and the checks of ``ups train``, ``tune`` and ``check`` call it; the
    commands that do not train import no torch, so neither may its module.
    :func:`ups.core.check_writable` probes a local folder.

    :raises ConfigError: naming the config key that sets the place, the place and why not.
    """

    def __call__(self, *, directory: Path, options: Any) -> None: ...


@attrs.frozen(kw_only=True)
class CheckpointBackendPlugin(PluginRecord):
    """A place and format to keep checkpoints in."""

    factory: CheckpointFactory
    probe: CheckpointProbe | None = None
    """Checks that checkpoints can be written there before any rank starts (name it with
    :func:`ups.core.imported` if its module imports what listing must not); ``None``: not
    checked, the first save tells."""


# ---------------------------------------------------------------------------------------------
# Launchers


@attrs.frozen(kw_only=True)
class LaunchRequest:
    """What to run: a config file on ``nnodes`` machines of ``nproc_per_node`` processes each."""

    config: Path
    nproc_per_node: int = 1
    nnodes: int = 1
    overrides: tuple[str, ...] = ()
    run_dir: Path = Path("runs")


class JobState(enum.StrEnum):
    """A job's state, as :meth:`Launcher.status` returns it.

    A ``str`` (``JobState.RUNNING == "RUNNING"``, printed as ``RUNNING``), so a launcher that
    returns the plain strings works alike.
    """

    PENDING = "PENDING"
    """Submitted, not yet running (queued, machines starting)."""
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    """Training exited 0."""
    FAILED = "FAILED"
    """Training failed, or the job ended without saying how."""
    CANCELLED = "CANCELLED"
    """Cancelled, or its machines are gone."""
    STOPPED = "STOPPED"
    """Ended, but its machines are kept, and billed, until ``cancel``."""


TERMINAL = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.STOPPED)
"""The states in which a job's work has ended (it does not leave them by itself); a
:class:`Launcher`'s ``status`` returns one of them or ``PENDING``/``RUNNING``."""


class Launcher(Protocol):
    """Starts and follows jobs on some infrastructure (modelled on torchx's schedulers)."""

    def dry_run(self, request: LaunchRequest) -> str:
        """Exactly what :meth:`submit` would run or send, secrets redacted."""
        ...

    def submit(self, request: LaunchRequest) -> str:
        """Start the job; return a handle that the other methods accept."""
        ...

    def status(self, handle: str) -> JobState:
        """The job's state: ``PENDING``, ``RUNNING`` or one of :data:`TERMINAL` (a
        :class:`JobState`, or the same string)."""
        ...

    def logs(self, handle: str) -> str:
        """The job's output so far."""
        ...

    def cancel(self, handle: str) -> None:
        """Stop the job and release what it holds."""
        ...


class LauncherFactory(Protocol):
    """Builds a launcher."""

    def __call__(self, *, options: Any) -> Launcher: ...


@attrs.frozen(kw_only=True)
class LauncherPlugin(PluginRecord):
    """A way to run a config somewhere: this machine, SLURM, a cloud."""

    factory: LauncherFactory


# ---------------------------------------------------------------------------------------------
# Commands


class CommandRunner(Protocol):
    """Runs a plugin's command with the parsed arguments; returns the exit status."""

    def __call__(self, args: argparse.Namespace, /) -> int: ...


class CommandFactory(Protocol):
    """Adds a command's arguments to its ``ups NAME`` parser; returns what runs it."""

    def __call__(self, parser: argparse.ArgumentParser, /) -> CommandRunner: ...


@attrs.frozen(kw_only=True)
class CommandPlugin(PluginRecord):
    """A subcommand of ``ups``: ``ups NAME ...``, listed by ``ups --help`` with
    ``description`` as its help. A :class:`~ups.core.UsageError` it raises is printed as one
    line, with exit status 2, like the built-in commands' errors. Its ``options``, when not
    ``NoOptions``, are the class of a top-level config section named like the command, which
    the command reads (ups-optuna's ``sweep``): ``ups validate`` checks that section against
    it (:meth:`~ups.core.Registry.command_sections`)."""

    factory: CommandFactory


# ---------------------------------------------------------------------------------------------
# The run


@attrs.frozen(kw_only=True)
class TrainResult:
    """What a run leaves behind; the same on every rank."""

    steps: int
    """Optimizer steps taken."""
    epochs: int
    """Epochs started."""
    losses: tuple[float, ...]
    """The training loss at each report, averaged over the interval and over all ranks."""
    checkpoint: str | None
    """Where the final checkpoint went."""
    preempted: bool = False
    """Whether a signal stopped the run early (saved where it stopped, to resume)."""
    metrics: tuple[dict[str, float], ...] = ()
    """Every report's metrics (``loss``, ``loss/<task>``, ``grad_norm``, ``lr``,
    ``samples_per_s``, ``oom_skipped``, user metrics, ...)."""
    eval_metrics: tuple[dict[str, float], ...] = ()
    """Every evaluation's metrics, over the whole evaluation set (``loss``, ``loss/<task>``)."""
    best: tuple[int, float] | None = None
    """Keep-best's best checkpoint (``checkpoint.options.keep_best``): its step and monitored
    value; ``None`` without keep-best, or when no evaluation has been ranked."""


# ---------------------------------------------------------------------------------------------
# Config sections


@attrs.frozen(kw_only=True)
class SectionPlugin(PluginRecord):
    """A config section of a plugin's own: ``plugins.NAME`` in the config holds its keys, checked
    against ``options`` by ``ups validate`` and ``ups train``. The plugin reads them back from
    :attr:`ups.core.Config.plugins` with :meth:`ups.core.Config.section`."""
