"""The ``ups`` command: ``train``, ``validate``, ``tune``, ``report`` and ``plugins``.

Usage errors (bad config, unknown plugin, missing file) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from . import launch, logs
from .config import Config, load_config
from .context import RunContext, launched
from .errors import UsageError
from .plugins import FAMILIES, Registry, load_plugins
from .validate import validate

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ups", description="DDP training done right, from one YAML file.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train", help="train a config, on --nproc local processes")
    train.add_argument("config", type=Path, help="the run's YAML file")
    train.add_argument(
        "--nproc", type=int, help="processes on this machine (default: distributed.nproc)"
    )
    train.add_argument(
        "--profile",
        type=int,
        metavar="STEPS",
        help="trace STEPS steps after warm-up with torch.profiler, per rank, and measure the "
        "communication profile (into RUN_DIR/profile)",
    )
    train.add_argument(
        "--allow-changed",
        action="append",
        default=[],
        metavar="KEY",
        help="resume although KEY changed since the checkpoint: seed, accumulation_steps or "
        "dataset (repeatable; checkpoint.allow_changed)",
    )
    _overrides(train)

    tune = commands.add_parser(
        "tune", help="find the largest per-rank batch size that fits on every rank"
    )
    tune.add_argument("config", type=Path)
    tune.add_argument("--nproc", type=int, help="processes on this machine")
    tune.add_argument("--start", type=int, default=1, help="the first batch size to try")
    tune.add_argument("--limit", type=int, help="the largest to try (default: a rank's data)")
    _overrides(tune)

    check = commands.add_parser("validate", help="check a config without training")
    check.add_argument("config", type=Path)
    check.add_argument("--nproc", type=int, help="check for this many processes")
    _overrides(check)

    commands.add_parser("plugins", help="list the plugins found and what they provide")

    report = commands.add_parser(
        "report", help="summarise a run folder's metrics and plot them into a PNG"
    )
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's folder")
    report.add_argument(
        "--output",
        type=Path,
        metavar="PATH",
        help="the figure's file (default: RUN_DIR/report.png)",
    )
    return parser


def _overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a config value, e.g. -o training.lr=3e-4 (repeatable)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ups`` command line; return its exit status."""
    logs.configure(RunContext())  # until a run knows its rank
    try:
        args = _parser().parse_args(argv)
        return _COMMANDS[args.command](args)
    except UsageError as error:
        print(f"ups: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except ChildFailedError as error:
        # Each failed rank, first to fail first: the message its error file holds (see
        # _train), else how the process ended.
        for rank, failure in sorted(error.failures.items(), key=lambda f: f[1].timestamp):
            message = failure.message
            if isinstance(message, dict):
                message = message.get("message", "")
            print(
                f"ups: rank {rank} failed: {message or f'exit code {failure.exitcode}'}",
                file=sys.stderr,
            )
        # Ranks refused bad input (a usage error: exit 2 in the rank), and any other rank was
        # stopped by a signal (the launcher ending the job): so does ups.
        codes = [failure.exitcode for failure in error.failures.values()]
        usage = EXIT_USAGE in codes and all(c == EXIT_USAGE or c < 0 for c in codes)
        return EXIT_USAGE if usage else EXIT_FAILED
    except SignalException as error:
        # The agent was signalled (SLURM, a spot instance, kill): it passed the signal on to
        # the ranks, which saved at their next step boundary and stopped (preempt_signals).
        print(
            f"ups: stopped by {signal.Signals(error.sigval).name}: the ranks saved where they "
            "stopped; resume with -o checkpoint.resume=latest",
            file=sys.stderr,
        )
        return 128 + error.sigval
    except KeyboardInterrupt:
        return 130


def _train(args: argparse.Namespace) -> int:
    if args.profile is not None:
        args.override.append(f"run.profile_steps={args.profile}")
    if args.allow_changed:
        args.override.append(f"checkpoint.allow_changed=[{', '.join(args.allow_changed)}]")
    config = load_config(args.config, args.override)
    nproc = args.nproc or config.distributed.nproc
    if not launched():
        _check(config, load_plugins(), nproc)
        if nproc > 1:
            launch.torchrun(args.config, nproc, args.override)
            return EXIT_OK
    # record: a launched rank's error goes to the file its elastic agent reads it from.
    record(launch.train_in_place)(config)
    return EXIT_OK


def _tune(args: argparse.Namespace) -> int:
    if args.start < 1 or (args.limit is not None and args.limit < args.start):
        raise UsageError(f"--start ({args.start}) must be >= 1 and --limit >= --start")
    config = load_config(args.config, args.override)
    nproc = args.nproc or config.distributed.nproc
    if not launched():
        _check(config, load_plugins(), nproc)
    size = launch.tune(config, nproc=nproc, start=args.start, limit=args.limit)
    if not launched():  # launched ranks log it (rank 0)
        print(f"training.batch_size: {size} fits on every rank ({nproc} processes)")
    return EXIT_OK


def _validate(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.override)
    _check(config, load_plugins(), args.nproc)
    print(f"{args.config}: ok")
    return EXIT_OK


def _check(config: Config, registry: Registry, nproc: int | None) -> None:
    for warning in validate(config, registry, nproc):
        structlog.get_logger().warning(warning)


def _plugins(args: argparse.Namespace) -> int:
    registry = load_plugins()
    rows = [("FAMILY", "NAME", "PLUGIN", "DISTRIBUTION", "STATUS")]
    versions = {p.name: f"{p.distribution} {p.version}".strip() for p in registry.plugins}
    for family in FAMILIES:
        for name, provided in sorted(registry.records(family).items()):
            rows.append(
                (family, name, provided.plugin, versions.get(provided.plugin, ""), "enabled")
            )
    for plugin in registry.plugins:
        if plugin.status != "enabled":
            status = plugin.status + (f": {plugin.error}" if plugin.error else "")
            rows.append(("-", "-", plugin.name, versions[plugin.name], status))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[4]
        )
    return EXIT_OK


def _report(args: argparse.Namespace) -> int:
    from .report import plot, read_metrics, run_name, summary

    records = read_metrics(args.run_dir)
    name = run_name(args.run_dir)
    output = args.output or args.run_dir / "report.png"
    plot(records, output, name)
    print(summary(records, name))
    print(f"plot: {output}")
    return EXIT_OK


_COMMANDS = {
    "tune": _tune,
    "train": _train,
    "validate": _validate,
    "plugins": _plugins,
    "report": _report,
}
