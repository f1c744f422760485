"""``ups launch``: start a config's training through a launcher plugin (``launch.name``), and
leave the launch record that ``ups status``, ``logs`` and ``cancel`` follow it by."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config._errors import UsageError
from ..launch._record import (
    DEFAULT_RUN_DIR,
    HELD,
    RECORD_FILE,
    LaunchRecord,
    build_launcher,
    new_record,
)
from ..plugin._manager import Registry, load_plugins
from ..plugin._records import TERMINAL, CommandRunner, LaunchRequest
from ._common import EXIT_OK, LauncherError, add_overrides, count, run_config
from ._launched import call_launcher


def command(parser: argparse.ArgumentParser) -> CommandRunner:
    """Add ``ups launch``'s arguments to ``parser``; return what runs it."""
    parser.add_argument("config", type=Path, help="the run's YAML file")
    parser.add_argument(
        "--launcher", metavar="NAME", help="the launcher plugin (default: the config's launch.name)"
    )
    parser.add_argument(
        "--nproc", type=count, help="processes per machine (default: distributed.nproc)"
    )
    parser.add_argument("--nnodes", type=count, default=1, help="machines (default: 1)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print exactly what would be run or sent, secrets redacted; start nothing",
    )
    add_overrides(parser)
    return _launch


def _launch(args: argparse.Namespace) -> int:
    config = run_config(args)
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
        text = call_launcher(name, "dry_run", lambda: launcher.dry_run(request))
        print(text, end="" if text.endswith("\n") else "\n")
        return EXIT_OK
    folder = request.run_dir / config.run.name
    _refuse_if_running(folder / RECORD_FILE, registry)
    handle = call_launcher(name, "submit", lambda: launcher.submit(request))
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
