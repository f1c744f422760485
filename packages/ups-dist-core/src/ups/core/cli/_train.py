"""``ups train``: train a config, in this process or on ``--nproc`` local processes under
torch's elastic agent; a run stopped by a preemption signal exits with
:data:`~ups.core.EXIT_PREEMPTED`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from ..config._config import Config
from ..config._errors import UsageError
from ..observe import _logs as logs
from ..plugin._manager import load_plugins
from ..plugin._records import CommandRunner
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_USAGE,
    add_overrides,
    check_config,
    count,
    failed,
    run_config,
)


def command(parser: argparse.ArgumentParser) -> CommandRunner:
    """Add ``ups train``'s arguments to ``parser``; return what runs it."""
    parser.add_argument("config", type=Path, help="the run's YAML file")
    parser.add_argument(
        "--nproc", type=count, help="processes on this machine (default: distributed.nproc)"
    )
    parser.add_argument(
        "--profile",
        type=int,
        metavar="STEPS",
        help="trace STEPS steps after warm-up with torch.profiler, per rank, and measure the "
        "communication profile (into RUN_DIR/profile)",
    )
    parser.add_argument(
        "--allow-changed",
        action="append",
        default=[],
        metavar="KEY",
        help="resume although KEY changed since the checkpoint: seed, accumulation_steps or "
        "dataset (repeatable; checkpoint.allow_changed)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        metavar="N",
        help="restart every rank after one fails, N times at most, resuming from the newest "
        "checkpoint (distributed.max_restarts)",
    )
    add_overrides(parser)
    return _train


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
    config = run_config(args)
    nproc = args.nproc or config.distributed.nproc
    if not launched():
        check_config(config, load_plugins(), nproc)
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
        return failed(error, config.run_dir / "logs")
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
