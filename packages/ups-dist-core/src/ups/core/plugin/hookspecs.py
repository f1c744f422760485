"""Every hook of the ``ups`` plugin contract, by family: this module is its table of contents.

A plugin is a module (or object) with functions named like these specs, marked with
:data:`ups.core.hookimpl`, and listed under the ``ups`` entry-point group of its distribution.
Hooks take keyword arguments only; an implementation may accept any subset of them.

Registration (samplers, comm hooks, strategies, checkpoint backends, launchers, commands, config sections)
    Each returns the records of what the plugin provides. The engine gathers them from all
    plugins; a name claimed by two plugins is an error naming both.

Training lifecycle (callbacks, loggers)
    Called on every rank, in step; decide for yourself whether to act on ``ctx.is_main`` only.
    Metrics passed to them are already aggregated across ranks, so every rank sees the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ._markers import hookspec

if TYPE_CHECKING:
    from ..config._config import Config
    from ..dist._context import RunContext
    from ._records import (
        CheckpointBackendPlugin,
        CommandPlugin,
        CommHookPlugin,
        LauncherPlugin,
        SamplerPlugin,
        SectionPlugin,
        StrategyPlugin,
        TrainResult,
    )

# ---------------------------------------------------------------------------------------------
# Registration


@hookspec
def ups_samplers() -> Iterable[SamplerPlugin]:
    """Register distributed samplers, selected by ``sampler: {name: ...}`` in the config.

    :returns: the :class:`~ups.core.plugin._records.SamplerPlugin` records this plugin provides.

    Example::

        @hookimpl
        def ups_samplers():
            return [SamplerPlugin(name="reverse", factory=make_reverse_sampler)]
    """


@hookspec
def ups_comm_hooks() -> Iterable[CommHookPlugin]:
    """Register DDP communication hooks, selected by ``comm_hook: {name: ...}``.

    :returns: the :class:`~ups.core.plugin._records.CommHookPlugin` records this plugin provides.
    """


@hookspec
def ups_strategies() -> Iterable[StrategyPlugin]:
    """Register strategies, how a run spreads its model over the ranks, selected by
    ``strategy: {name: ...}`` (``ddp`` is built in; ups-fsdp adds ``zero`` and ``fsdp``).

    :returns: the :class:`~ups.core.plugin._records.StrategyPlugin` records this plugin provides.
    """


@hookspec
def ups_checkpoint_backends() -> Iterable[CheckpointBackendPlugin]:
    """Register checkpoint backends, selected by ``checkpoint: {name: ...}``.

    :returns: the :class:`~ups.core.plugin._records.CheckpointBackendPlugin` records of this plugin.
    """


@hookspec
def ups_launchers() -> Iterable[LauncherPlugin]:
    """Register launchers (local, SLURM, clouds), selected by ``launch: {name: ...}``.

    :returns: the :class:`~ups.core.plugin._records.LauncherPlugin` records this plugin provides.
    """


@hookspec
def ups_commands() -> Iterable[CommandPlugin]:
    """Register subcommands of the ``ups`` command line: ``ups NAME ...``.

    A record's ``factory`` receives the command's ``argparse`` parser, adds its arguments and
    returns the function that runs the command with the parsed arguments and returns its exit
    status. A name that a built-in command has is an error naming the plugin.

    :returns: the :class:`~ups.core.plugin._records.CommandPlugin` records this plugin provides.

    Example::

        def hello(parser):
            parser.add_argument("who")

            def run(args):
                print(f"hello {args.who}")
                return 0

            return run

        @hookimpl
        def ups_commands():
            return [CommandPlugin(name="hello", factory=hello, description="say hello")]
    """


@hookspec
def ups_config_sections() -> Iterable[SectionPlugin]:
    """Declare config sections of the plugin's own: ``plugins: {NAME: {...}}`` in the config.

    :returns: the :class:`~ups.core.plugin._records.SectionPlugin` records this plugin provides.

    Example::

        @attrs.frozen(kw_only=True)
        class TrackerOptions:
            project: str = "ups"

        @hookimpl
        def ups_config_sections():
            return [SectionPlugin(name="tracker", options=TrackerOptions)]
    """


# ---------------------------------------------------------------------------------------------
# Training lifecycle


@hookspec
def ups_run_start(ctx: RunContext, config: Config) -> None:
    """Training is about to start: the process group is up, the model and data are built.

    :param ctx: this rank's run context.
    :param config: the validated configuration of the run.
    """


@hookspec
def ups_step_end(ctx: RunContext, step: int, metrics: Mapping[str, float]) -> None:
    """Metrics of the report made at optimizer step ``step`` (every ``run.log_every`` steps)
    are ready; called once their all-reduce completed, after the next step.

    :param ctx: this rank's run context.
    :param step: the optimizer step the metrics were taken at.
    :param metrics: metrics averaged over all ranks since the last call (``loss``, ...).
    """


@hookspec
def ups_eval_end(ctx: RunContext, step: int, metrics: Mapping[str, float]) -> None:
    """An evaluation pass ended.

    :param ctx: this rank's run context.
    :param step: the optimizer step the evaluation was made at.
    :param metrics: evaluation metrics over the whole evaluation set, all ranks together.
    """


@hookspec
def ups_checkpoint_saved(ctx: RunContext, step: int, location: str) -> None:
    """A checkpoint was saved and committed.

    :param ctx: this rank's run context.
    :param step: the optimizer step the checkpoint holds.
    :param location: where the checkpoint backend put it (a path or URL).
    """


@hookspec
def ups_checkpoint_state(ctx: RunContext) -> Mapping[str, Any] | None:
    """Add this plugin's own state to the checkpoint being saved (a collective save: called on
    every rank, before the engine hands the state to the backend).

    :param ctx: this rank's run context.
    :returns: ``{key: state}``, a key of the plugin's own (a key two plugins return is an
        error naming it), or ``None``. Plain data only: tensors, numbers, strings, and lists,
        tuples and dicts of them, as ``torch.load(weights_only=True)`` reads back.
    """


@hookspec
def ups_checkpoint_restore(ctx: RunContext, state: Mapping[str, Any]) -> None:
    """A run is resuming: restore this plugin's state from what :func:`ups_checkpoint_state`
    returned when the checkpoint was saved.

    :param ctx: this rank's run context.
    :param state: every plugin's saved state by key: what this rank saved, or rank 0's when
        the checkpoint was saved by another number of ranks. A key may be missing (the plugin
        was not installed then).
    """


@hookspec
def ups_guard_record(ctx: RunContext, record: Mapping[str, Any]) -> None:
    """The training guard (``training.guard``) acted on a bad optimizer step and recorded it:
    called on rank 0 only, once per record, right after it is appended to the run folder's
    ``guard.jsonl``; for a stop, before the run's error propagates (``ups_error`` follows).

    :param ctx: rank 0's run context.
    :param record: plain JSON data, the line written: ``step`` (the global step attempted),
        ``epoch`` (counted from 1), ``batches`` (``[first, last]``: the step's batches in each
        rank's share of the epoch, counted from 1), ``action`` (``skip``, ``rollback`` or
        ``stop``), ``reason`` (why the step is bad, and why a stop stopped), and ``ranks``:
        for each rank, ``{rank, finite, tasks, indices}``: whether its losses were finite,
        the tasks of its batches (``data.tasks`` names) and its batches' sample indices.
    """


@hookspec
def ups_run_end(ctx: RunContext, result: TrainResult) -> None:
    """Training finished normally.

    :param ctx: this rank's run context.
    :param result: the run's summary, the same on every rank.
    """


@hookspec
def ups_error(ctx: RunContext, error: BaseException) -> None:
    """Training stopped with an exception on this rank; called before it propagates.

    :param ctx: this rank's run context.
    :param error: the exception.
    """
