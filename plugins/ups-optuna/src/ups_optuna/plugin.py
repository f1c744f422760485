"""The ``optuna`` plugin: the ``ups sweep`` command, and the reporting of a trial's
intermediate values for pruning.

Pruning is a synchronised decision: on a trial's report steps every rank calls the hook at the
same step with the same metrics; rank 0 alone reports to the study and asks the pruner,
:func:`ups.core.decide` gives every rank its answer, and on "prune" every rank raises
:class:`~ups_optuna.link.TrialPrunedError` together, so no rank is left waiting in a
collective. Outside a sweep (no ``UPS_OPTUNA_TRIAL``) the hooks do nothing.

This module imports neither Optuna nor the sweep driver: every ``ups`` process loads it. The
command's options are the ``sweep`` section's class, so that ``ups validate`` checks that
section too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ups.core import CommandPlugin, ConfigError, UsageError, hookimpl

from . import link
from .space import Sweep

if TYPE_CHECKING:
    from ups.core import RunContext


def sweep_command(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """``ups sweep CONFIG --trials N [--study NAME] [--storage URL] [--launcher NAME]
    [--nproc N] [-o KEY=VALUE ...]``."""
    parser.add_argument("config", type=Path, help="a ups config with a sweep section")
    parser.add_argument(
        "--trials", type=int, required=True, help="finished trials the study should hold"
    )
    parser.add_argument("--study", metavar="NAME", help="the study's name (default: run.name)")
    parser.add_argument(
        "--storage",
        metavar="URL",
        help="Optuna's RDB storage (default: sqlite:///RUN_OUTPUT_DIR/STUDY/study.db)",
    )
    parser.add_argument(
        "--launcher",
        metavar="NAME",
        help="run each trial through this launcher plugin (default: torchrun, here)",
    )
    parser.add_argument(
        "--nproc", type=int, help="processes per trial (default: distributed.nproc)"
    )
    parser.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a config value in every trial, e.g. -o training.epochs=3 (repeatable)",
    )
    return run_sweep


def run_sweep(args: argparse.Namespace) -> int:
    """Run ``ups sweep``; print the best trial and where its config and the plot went."""
    from .sweep import SweepInterruptedError, TrialFailedError, sweep

    if args.trials < 1:
        raise UsageError(f"--trials must be >= 1, not {args.trials}")
    if args.nproc is not None and args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, not {args.nproc}")
    try:
        result = sweep(
            args.config,
            trials=args.trials,
            study=args.study,
            storage=args.storage,
            launcher=args.launcher,
            nproc=args.nproc,
            overrides=args.override,
        )
    except TrialFailedError as error:
        print(f"ups: error: {error}", file=sys.stderr)
        return 1
    except SweepInterruptedError as error:
        print(f"ups: {error}", file=sys.stderr)
        return 128 + error.signum  # as a shell reports a command a signal stopped
    print(f"best trial: {result.best_trial} ({result.best_value:.6g}) {result.best_params}")
    print(f"best config: {result.best_config}")
    print(f"history: {result.history}")
    return 0


@hookimpl
def ups_commands() -> list[CommandPlugin]:
    return [
        CommandPlugin(
            name="sweep",
            factory=sweep_command,
            options=Sweep,
            description="search hyperparameters of a config with Optuna (its sweep section)",
        )
    ]


def _prune(
    ctx: RunContext, kind: Literal["eval", "train"], step: int, metrics: Mapping[str, float]
) -> None:
    trial = link.current()
    if trial is None or trial.objective.kind != kind:
        return
    name = trial.objective.metric
    if name not in metrics:  # the same metrics on every rank: every rank raises
        raise ConfigError(
            "sweep.objective.metric",
            f"{kind} metrics have no {name!r}; they have: {', '.join(sorted(metrics))}",
        )
    value = metrics[name]
    from ups.core import decide  # imports torch: in a rank, never in the command line

    if decide(ctx, lambda: link.report(trial, step, value)):
        raise link.TrialPrunedError(f"trial pruned at step {step}: {kind} {name} = {value:.6g}")


@hookimpl
def ups_step_end(ctx: RunContext, step: int, metrics: Mapping[str, float]) -> None:
    _prune(ctx, "train", step, metrics)


@hookimpl
def ups_eval_end(ctx: RunContext, step: int, metrics: Mapping[str, float]) -> None:
    _prune(ctx, "eval", step, metrics)
