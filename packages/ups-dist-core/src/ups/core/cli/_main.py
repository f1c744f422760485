"""The ``ups`` command: ``train``, ``validate``, ``tune``, ``check``, ``report``, ``plugins``,
and ``launch``, ``status``, ``logs`` and ``cancel`` (through a launcher plugin; see
:mod:`ups.core.launch._record`), and the commands plugins add (``ups_commands``).

Usage errors (bad config, unknown plugin, missing file) print one line and exit with status 2.

Commands that do not train import neither torch nor the engine (the modules that need torch are
imported by the commands that use them), so that ``ups --help``, ``plugins``, ``status`` and the
like answer at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

import structlog

from ..config._config import Config, load_config, read_config
from ..config._errors import ConfigError, UsageError
from ..launch._record import (
    DEFAULT_RUN_DIR,
    HELD,
    RECORD_FILE,
    LaunchRecord,
    build_launcher,
    find_record,
    held_note,
    new_record,
)
from ..observe import _logs as logs
from ..plugin._manager import FAMILIES, Family, Registry, load_plugins
from ..plugin._records import TERMINAL, CommandPlugin, Launcher, LaunchRequest

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_PREEMPTED = 75
"""A preemption signal stopped the run, every rank saved: resumable (sysexits' EX_TEMPFAIL)."""
T = TypeVar("T")


class LauncherError(Exception):
    """A launcher's call failed for a reason other than the user's input: exit status 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _count(text: str) -> int:
    """A count of processes or machines: a whole number >= 1 (``--nproc``, ``--nnodes``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def _tolerance(text: str) -> float:
    """``ups check --tolerance``: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, not {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="ups", description="DDP training done right, from one YAML file.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train", help="train a config, on --nproc local processes")
    train.add_argument("config", type=Path, help="the run's YAML file")
    train.add_argument(
        "--nproc", type=_count, help="processes on this machine (default: distributed.nproc)"
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
    train.add_argument(
        "--max-restarts",
        type=int,
        metavar="N",
        help="restart every rank after one fails, N times at most, resuming from the newest "
        "checkpoint (distributed.max_restarts)",
    )
    _overrides(train)

    tune = commands.add_parser(
        "tune", help="find the largest per-rank batch size that fits on every rank"
    )
    tune.add_argument("config", type=Path)
    tune.add_argument("--nproc", type=_count, help="processes on this machine")
    tune.add_argument("--start", type=int, default=1, help="the first batch size to try")
    tune.add_argument("--limit", type=int, help="the largest to try (default: a rank's data)")
    _overrides(tune)

    check = commands.add_parser("validate", help="check a config without training")
    check.add_argument("config", type=Path)
    check.add_argument("--nproc", type=_count, help="check for this many processes")
    _overrides(check)

    exact = commands.add_parser(
        "check",
        help="prove that W ranks train as one process of W times the batch, and "
        "accumulation as a bigger batch, for this config's model, step and data",
    )
    exact.add_argument("config", type=Path)
    exact.add_argument(
        "--nproc",
        type=_count,
        metavar="W",
        help="ranks to compare (default: distributed.nproc, at least 2)",
    )
    exact.add_argument(
        "--steps", type=_count, default=5, metavar="N", help="optimizer steps (default: 5)"
    )
    exact.add_argument(
        "--tolerance",
        type=_tolerance,
        default=1e-5,
        metavar="T",
        help="the largest parameter difference that agrees (default: 1e-5)",
    )
    exact.add_argument(
        "--keep-precision",
        action="store_true",
        help="run training.precision as configured (bf16, fp16), not fp32",
    )
    _overrides(exact)

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

    launch_ = commands.add_parser(
        "launch", help="start a config's training through a launcher (launch.name)"
    )
    launch_.add_argument("config", type=Path, help="the run's YAML file")
    launch_.add_argument(
        "--launcher", metavar="NAME", help="the launcher plugin (default: the config's launch.name)"
    )
    launch_.add_argument(
        "--nproc", type=_count, help="processes per machine (default: distributed.nproc)"
    )
    launch_.add_argument("--nnodes", type=_count, default=1, help="machines (default: 1)")
    launch_.add_argument(
        "--dry-run",
        action="store_true",
        help="print exactly what would be run or sent, secrets redacted; start nothing",
    )
    _overrides(launch_)

    run_help = "a launched run: its name (runs/RUN/launch.json), its folder or its launch.json"
    status = commands.add_parser("status", help="print a launched run's state")
    status.add_argument("run", metavar="RUN", help=run_help)
    logs_ = commands.add_parser("logs", help="print a launched run's output")
    logs_.add_argument("run", metavar="RUN", help=run_help)
    logs_.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="print new output until the run ends; exit 0 if it succeeded, else 1",
    )
    logs_.add_argument(
        "--interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how often --follow asks the launcher (default: 2)",
    )
    cancel = commands.add_parser("cancel", help="stop a launched run and release what it holds")
    cancel.add_argument("run", metavar="RUN", help=run_help)
    if not (argv and argv[0] in _COMMANDS):  # a built-in command loads no plugin to parse
        _plugin_commands(commands)
    return parser


def _plugin_commands(commands: argparse._SubParsersAction[_Parser]) -> None:
    """Add ``ups NAME`` for every command a plugin registers; its runner is ``args.ups_command``."""
    for name, provided in sorted(load_plugins().records("command").items()):
        if name in _COMMANDS:
            raise UsageError(
                f"plugin {provided.plugin!r} registers the command {name!r}, which is built in; "
                "uninstall it or block it with UPS_BLOCK_PLUGINS"
            )
        record = cast(CommandPlugin, provided.record)
        command = commands.add_parser(name, help=record.description)
        command.set_defaults(ups_command=record.factory(command))


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
    logs.configure(None)  # until a run knows its rank
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parser(argv).parse_args(argv)
        run = _COMMANDS.get(args.command) or args.ups_command  # a plugin's (_plugin_commands)
        return int(run(args))
    except UsageError as error:
        print(f"ups: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except LauncherError as error:
        print(f"ups: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    except Exception as error:
        if "torch" not in sys.modules:  # not an error of torch's elastic agent: a bug
            raise
        return _agent_failure(error)


def _agent_failure(error: Exception) -> int:
    """The exit status for an error of torch's elastic agent (``ups train --nproc``, or a
    plugin's command that trains), printed in one line per rank; any other error is raised."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(error, ChildFailedError):
        return _failed(error)
    if isinstance(error, SignalException):
        # The agent was signalled with a signal ranks do not save on: it passed it on to them.
        print(f"ups: stopped by {signal.Signals(error.sigval).name}", file=sys.stderr)
        return 128 + error.sigval
    raise error


def _failed(error: ChildFailedError, logs_dir: Path | None = None) -> int:
    """Print one line for each distinct error of the failed ranks, first to fail first
    (:func:`~ups.core.launch._processes.rank_failures`), with the rank's log file in ``logs_dir``, which
    holds its traceback, if there is one. Return the exit status."""
    from ..launch._processes import failure_message, rank_failures

    # Ranks refused bad input (a usage error: exit 2 in the rank), and any other rank was
    # stopped by a signal (the launcher ending the job): so does ups, saying only the refusal.
    failures = error.failures.values()
    codes = [failure.exitcode for failure in failures]
    usage = EXIT_USAGE in codes and all(c == EXIT_USAGE or c < 0 for c in codes)
    refused = {failure_message(f) for f in failures if f.exitcode == EXIT_USAGE}
    for rank, message in rank_failures(error):
        if usage and message not in refused:  # a rank stopped, however late it said it
            continue
        line = f"ups: rank {rank} failed: {message}"
        log_file = None if logs_dir is None else logs_dir / f"rank{rank}.jsonl"
        if log_file is not None and log_file.is_file():
            line += f" (traceback: {log_file})"
        print(line, file=sys.stderr)
    return EXIT_USAGE if usage else EXIT_FAILED


def _train(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    from ..dist._context import launched
    from ..engine._rundir import check_free
    from ..launch import _processes as launch

    if args.profile is not None:
        args.override.append(f"run.profile_steps={args.profile}")
    if args.allow_changed:
        args.override.append(f"checkpoint.allow_changed=[{', '.join(args.allow_changed)}]")
    if args.max_restarts is not None:
        args.override.append(f"distributed.max_restarts={args.max_restarts}")
    config = _run_config(args)
    nproc = args.nproc or config.distributed.nproc
    if not launched():
        _check(config, load_plugins(), nproc)
        check_free(config.run_dir)  # before any rank starts; rank 0 locks it (own_run_dir)
        if nproc > 1:
            return _train_on_processes(args, config, nproc)
    # record: a launched rank's error goes to the file its elastic agent reads it from, and
    # the agent's launcher prints it, one line: its traceback is in the rank's log file.
    try:
        result = record(launch.train_in_place)(config)
    except Exception as error:
        if logs.AGENT_ERROR_FILE not in os.environ:
            raise
        return EXIT_USAGE if isinstance(error, UsageError) else EXIT_FAILED
    assert result is not None  # record returns what it wraps returns, or raises
    # Under an elastic agent a rank exits 0, else the agent would restart it; the agent's
    # process (ups train --nproc) tells the preemption.
    agent = "TORCHELASTIC_RUN_ID" in os.environ
    if not agent:
        _where_the_files_are(config)
    return EXIT_PREEMPTED if result.preempted and not agent else EXIT_OK


def _run_config(args: argparse.Namespace) -> Config:
    """The config a run trains on (``ups train``, ``tune``, ``check``, ``launch``): a section
    that a plugin's command reads instead (ups-optuna's ``sweep``) is refused naming that
    command.

    :raises ConfigError: as :func:`~ups.core.load_config` does.
    """
    try:
        return load_config(args.config, args.override)
    except ConfigError:
        data = read_config(args.config, args.override)
        for name in load_plugins().command_sections():
            if name in data:
                raise ConfigError(
                    f"{args.config}: {name}",
                    f"is read by `ups {name}`, not by a run: `ups {name} {args.config}` "
                    "trains the configs it makes of this one",
                ) from None
        raise


def _where_the_files_are(config: Config) -> None:
    """The closing line of ``ups train``: the run's folder, and how to plot it."""
    print(f"ups: the run's files are in {config.run_dir}; plot them: ups report {config.run_dir}")


def _train_on_processes(args: argparse.Namespace, config: Config, nproc: int) -> int:
    """``ups train --nproc N``: the elastic agent over N ranks. A preemption signal to the agent
    goes on to the ranks (torch's agent forwards SIGTERM and SIGINT; ups adds the other
    ``preempt_signals``); a run whose ranks saved and stopped for one (they exit 0, so that the
    agent does not restart them, and rank 0 leaves ``preempted.json``) exits with
    :data:`EXIT_PREEMPTED`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ..engine._rundir import PREEMPTED
    from ..launch import _processes as launch

    preempt = {signal.Signals[name] for name in config.checkpoint.preempt_signals}
    previous = {sig: signal.signal(sig, _raise_signal_exception) for sig in preempt}
    record = config.run_dir / PREEMPTED
    how = ""
    try:
        launch.torchrun(args.config, nproc, args.override, config.distributed.max_restarts)
    except ChildFailedError as error:
        return _failed(error, config.run_dir / "logs")
    except SignalException as error:
        if error.sigval not in preempt or not record.is_file():
            raise
        how = f" by {signal.Signals(error.sigval).name}"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _where_the_files_are(config)
    if not record.is_file():
        return EXIT_OK
    step = json.loads(record.read_text())["step"]
    print(
        f"ups: preempted{how}: the ranks saved at step {step}; resume with "
        "-o checkpoint.resume=latest",
        file=sys.stderr,
    )
    return EXIT_PREEMPTED


def _raise_signal_exception(signum: int, _frame: object) -> None:
    """What torch's agent does on SIGTERM: raise, so that it passes the signal to the ranks."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    raise SignalException(f"ups got signal {signum}", sigval=signal.Signals(signum))


def _tune(args: argparse.Namespace) -> int:
    if args.start < 1 or (args.limit is not None and args.limit < args.start):
        raise UsageError(f"--start ({args.start}) must be >= 1 and --limit >= --start")
    from ..dist._context import launched
    from ..launch import _processes as launch

    config = _run_config(args)
    nproc = args.nproc or config.distributed.nproc
    if not launched():
        _check(config, load_plugins(), nproc)
    size = launch.tune(config, nproc=nproc, start=args.start, limit=args.limit)
    if not launched():  # launched ranks log it (rank 0)
        print(f"training.batch_size: {size} fits on every rank ({nproc} processes)")
    return EXIT_OK


def _validate(args: argparse.Namespace) -> int:
    """``ups validate``: ``CONFIG: ok``, then a line for each plugin name the config selects
    that a plugin took from a built-in (the config is valid, but not with the built-in)."""
    registry = load_plugins()  # first: the sections of its commands (sweep) are checked too
    config = load_config(args.config, args.override, sections=registry.command_sections())
    _check(config, registry, args.nproc)
    print(f"{args.config}: ok")
    selected: list[tuple[str, Family, str]] = [
        ("sampler", "sampler", config.sampler.name),
        ("comm_hook", "comm_hook", config.comm_hook.name),
        ("checkpoint", "checkpoint", config.checkpoint.name),
    ]
    if config.eval is not None:
        selected.append(("eval.sampler", "sampler", config.eval.sampler.name))
    for key, family, name in selected:
        replaced = registry.replaced(family, name)
        if replaced is not None:
            print(f"{key}.name: note: {replaced}")
    return EXIT_OK


def _check_exact(args: argparse.Namespace) -> int:
    """``ups check``: the three ways of running a few steps, compared (:mod:`ups.core.cli._check`);
    exit 0 when they agree and nothing breaks equivalence, else 1."""
    from ..dist._context import launched
    from ._check import check

    config = _run_config(args)
    nproc = args.nproc or max(config.distributed.nproc, 2)
    if nproc < 2:
        raise UsageError("--nproc: must be >= 2: one process has nothing to compare")
    if launched():
        raise UsageError("ups check starts its own processes: run it outside torchrun and srun")
    registry = load_plugins()
    _check(config, registry, nproc)
    report = check(
        config,
        registry,
        nproc=nproc,
        steps=args.steps,
        tolerance=args.tolerance,
        keep_precision=args.keep_precision,
    )
    print(report.render(str(args.config)))
    return EXIT_OK if report.exact else EXIT_FAILED


def _check(config: Config, registry: Registry, nproc: int | None) -> None:
    """Validate ``config``, logging its warnings. Under ``UPS_TRACEBACK``, the error of a
    module or file that failed to import is printed with its traceback first."""
    from ..config._user_code import TRACEBACK_ENV
    from ..config._validate import validate

    try:
        warnings = validate(config, registry, nproc)
    except UsageError as error:
        if error.__cause__ is not None and os.environ.get(TRACEBACK_ENV):
            traceback.print_exception(error.__cause__)
        raise
    for warning in warnings:
        structlog.get_logger().warning(warning)


def _plugins(args: argparse.Namespace) -> int:
    registry = load_plugins()
    header = ("FAMILY", "NAME", "PLUGIN", "DISTRIBUTION", "STATUS", "DESCRIPTION")
    records = [header]
    # A name's records are the enabled plugin's, never those of a same-named one that failed.
    versions = {p.name: p.source for p in registry.plugins if p.status == "enabled"}
    for family in FAMILIES:
        for name, provided in sorted(registry.records(family).items()):
            source = versions.get(provided.plugin, "")
            description = provided.record.description
            records.append((family, name, provided.plugin, source, "enabled", description))
    others = [  # a blocked or failed plugin's row: its status, which may be long, comes last
        ("-", "-", p.name, p.source, p.status + (f": {p.error}" if p.error else ""), "")
        for p in registry.plugins
        if p.status != "enabled"
    ]
    widths = [max(len(row[i]) for row in records + others) for i in range(4)]
    widths.append(max(len(row[4]) for row in records))
    for row in records + others:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[5]]).rstrip())
    return EXIT_OK


def _report(args: argparse.Namespace) -> int:
    """``ups report``: the summary table first, which needs no matplotlib, then the figure;
    without matplotlib, a line saying what draws it (an error when ``--output`` asked for it)."""
    from ..observe._summary import NoMatplotlibError, write_report

    try:
        output, _ = write_report(args.run_dir, args.output, show=print)
    except NoMatplotlibError as error:
        if args.output is not None:
            raise
        print(f"plot: not drawn: {error}")
        return EXIT_OK
    print(f"plot: {output}")
    return EXIT_OK


def _launch(args: argparse.Namespace) -> int:
    config = _run_config(args)
    name = args.launcher or config.launch.name
    if name is None:
        raise UsageError(
            "launch.name: no launcher chosen; set launch.name in the config "
            "(e.g. launch: {name: local}) or pass --launcher NAME (see ups plugins)"
        )
    # The config's options are for the launcher it names: another one chosen with --launcher
    # starts from its defaults (set its options with -o launch.name=NAME -o launch.options...).
    options = config.launch.options if config.launch.name in (None, name) else {}
    registry = load_plugins()
    launcher = build_launcher(registry, name, options)
    request = LaunchRequest(
        config=args.config,
        nproc_per_node=args.nproc or config.distributed.nproc,
        nnodes=args.nnodes,
        overrides=tuple(args.override),
        run_dir=Path(config.run.output_dir),
    )
    if args.dry_run:
        text = _call(name, "dry_run", lambda: launcher.dry_run(request))
        print(text, end="" if text.endswith("\n") else "\n")
        return EXIT_OK
    folder = request.run_dir / config.run.name
    _refuse_if_running(folder / RECORD_FILE, registry)
    handle = _call(name, "submit", lambda: launcher.submit(request))
    record = new_record(name, options, handle, request)
    try:
        path = record.write(folder)
    except OSError as error:
        raise LauncherError(
            f"the job was submitted ({name}: {handle}) but its launch record could not be "
            f"written to {folder / RECORD_FILE}: {error}; cancel it through {name} if need be"
        ) from None
    run = config.run.name if (DEFAULT_RUN_DIR / config.run.name / RECORD_FILE).is_file() else path
    print(f"launched {config.run.name!r} with {name}: {handle}")
    print(f"record: {path}")
    print(f"follow: ups status {run} | ups logs {run} --follow | ups cancel {run}")
    return EXIT_OK


def _refuse_if_running(path: Path, registry: Registry) -> None:
    """Refuse to replace the record of a job that has not ended: it would be lost track of."""
    if not path.is_file():
        return
    try:
        previous = LaunchRecord.read(path)
        launcher = build_launcher(registry, previous.launcher, previous.options, str(path))
        state = launcher.status(previous.handle)
    except Exception:  # a record that cannot be followed any more does not hold a job
        return
    if state not in TERMINAL or state in HELD:
        raise UsageError(
            f"{path}: the run's previous job ({previous.launcher}: {previous.handle}) is "
            f"{state}; cancel it (ups cancel {path.parent}), or choose another run.name "
            "(-o run.name=...)"
        )


def _launched(run: str) -> tuple[LaunchRecord, Launcher]:
    path = find_record(run)
    record = LaunchRecord.read(path)
    return record, build_launcher(load_plugins(), record.launcher, record.options, str(path))


def _call(launcher: str, method: str, call: Callable[[], T]) -> T:
    """``call()``; an exception other than a usage error becomes :class:`LauncherError`."""
    try:
        return call()
    except UsageError:
        raise
    except Exception as error:
        raise LauncherError(
            f"launcher {launcher!r}: {method} failed: {type(error).__name__}: {error}"
        ) from error


def _status(args: argparse.Namespace) -> int:
    record, launcher = _launched(args.run)
    state = _call(record.launcher, "status", lambda: launcher.status(record.handle))
    print(state)
    note = held_note(state, args.run)
    if note is not None:
        print(f"ups: {args.run}: {note}", file=sys.stderr)
    return EXIT_OK


def _logs(args: argparse.Namespace) -> int:
    record, launcher = _launched(args.run)
    if not args.follow:
        text = _call(record.launcher, "logs", lambda: launcher.logs(record.handle))
        sys.stdout.write(text)
        return EXIT_OK
    if args.interval <= 0:
        raise UsageError(f"--interval must be > 0, not {args.interval}")
    seen = ""
    while True:
        # The state first: logs read after a terminal state hold the job's last words.
        state = _call(record.launcher, "status", lambda: launcher.status(record.handle))
        text = _call(record.launcher, "logs", lambda: launcher.logs(record.handle))
        sys.stdout.write(text[len(seen) :] if text.startswith(seen) else text)
        sys.stdout.flush()
        seen = text
        if state in TERMINAL:
            note = held_note(state, args.run)
            print(f"ups: {args.run}: {state}" + (f": {note}" if note else ""), file=sys.stderr)
            return EXIT_OK if state == "SUCCEEDED" else EXIT_FAILED
        time.sleep(args.interval)


def _cancel(args: argparse.Namespace) -> int:
    record, launcher = _launched(args.run)
    _call(record.launcher, "cancel", lambda: launcher.cancel(record.handle))
    print(_call(record.launcher, "status", lambda: launcher.status(record.handle)))
    return EXIT_OK


_COMMANDS = {
    "tune": _tune,
    "train": _train,
    "validate": _validate,
    "check": _check_exact,
    "plugins": _plugins,
    "report": _report,
    "launch": _launch,
    "status": _status,
    "logs": _logs,
    "cancel": _cancel,
}
