"""The ``ups`` command: ``train``, ``validate``, ``tune``, ``check``, ``report``, ``export``,
``plugins``, and ``launch``, ``status``, ``logs`` and ``cancel`` (through a launcher plugin; see
:mod:`ups.core.launch._record`), and the commands plugins add (``ups_commands``).

Each built-in command is a :class:`~ups.core.plugin._records.CommandPlugin` record, as a
plugin's command is, whose factory (in its own module of :mod:`ups.core.cli`) adds its
arguments and returns what runs it. Only the factory of the command run is called, so that
``ups --help`` needs only the descriptions.

Usage errors (bad config, unknown plugin, missing file) print one line and exit with status 2.

Commands that do not train import neither torch nor the engine (the modules that need torch are
imported by the commands that use them), so that ``ups --help``, ``plugins``, ``status`` and the
like answer at once.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import cast

from .._lazy import imported
from ..config._errors import UsageError
from ..observe import _logs as logs
from ..plugin._manager import load_plugins
from ..plugin._records import CommandPlugin
from ._common import EXIT_FAILED, EXIT_USAGE, LauncherError, Parser, failed


def _built_in(name: str, factory: str, description: str) -> CommandPlugin:
    """The record of the built-in command ``ups NAME``, its factory ``ups.core.cli.FACTORY``."""
    return CommandPlugin(
        name=name, description=description, factory=imported(f"ups.core.cli.{factory}")
    )


_COMMANDS = {
    record.name: record
    for record in (
        _built_in("train", "_train:command", "train a config, on --nproc local processes"),
        _built_in(
            "tune", "_tune:command", "find the largest per-rank batch size that fits on every rank"
        ),
        _built_in("validate", "_validate:command", "check a config without training"),
        _built_in(
            "check",
            "_check:command",
            "prove that W ranks train as one process of W times the batch, and "
            "accumulation as a bigger batch, for this config's model, step and data",
        ),
        _built_in("plugins", "_plugins:command", "list the plugins found and what they provide"),
        _built_in(
            "report",
            "_report:command",
            "summarise a run folder's metrics and plot them into a PNG",
        ),
        _built_in(
            "export",
            "_export:command",
            "write a run's trained weights as a plain state_dict file",
        ),
        _built_in(
            "launch",
            "_launch:command",
            "start a config's training through a launcher (launch.name)",
        ),
        _built_in("status", "_launched:status_command", "print a launched run's state"),
        _built_in("logs", "_launched:logs_command", "print a launched run's output"),
        _built_in(
            "cancel", "_launched:cancel_command", "stop a launched run and release what it holds"
        ),
    )
}
"""The built-in commands, in the order ``ups --help`` lists them."""


def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = Parser(prog="ups", description="DDP training done right, from one YAML file.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = argv[0] if argv else None
    _add_commands(commands, _COMMANDS, run)
    if run not in _COMMANDS:  # a built-in command loads no plugin to parse
        _add_commands(commands, _plugin_commands(), run)
    return parser


def _plugin_commands() -> dict[str, CommandPlugin]:
    """The commands plugins register, by name; one named like a built-in one is refused."""
    found = {}
    for name, provided in sorted(load_plugins().records("command").items()):
        if name in _COMMANDS:
            raise UsageError(
                f"plugin {provided.plugin!r} registers the command {name!r}, which is built in; "
                "uninstall it or block it with UPS_BLOCK_PLUGINS"
            )
        found[name] = cast(CommandPlugin, provided.record)
    return found


def _add_commands(
    commands: argparse._SubParsersAction[Parser],
    records: Mapping[str, CommandPlugin],
    run: str | None,
) -> None:
    """Add ``ups NAME`` for each record, with its description as help; the command ``run``'s
    factory adds its arguments, and what it returns runs it (``args.ups_command``)."""
    for name, record in records.items():
        command = commands.add_parser(name, help=record.description)
        if name == run:
            command.set_defaults(ups_command=record.factory(command))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ups`` command line; return its exit status."""
    logs.configure(None)  # until a run knows its rank
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parser(argv).parse_args(argv)
        return int(args.ups_command(args))
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
        return failed(error)
    if isinstance(error, SignalException):
        # The agent was signalled with a signal ranks do not save on: it passed it on to them.
        print(f"ups: stopped by {signal.Signals(error.sigval).name}", file=sys.stderr)
        return 128 + error.sigval
    raise error
