"""``ups validate``: check a config without training."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config._config import load_config
from ..plugin._manager import Family, load_plugins
from ..plugin._records import CommandRunner
from ._common import EXIT_OK, add_overrides, check_config, count


def command(parser: argparse.ArgumentParser) -> CommandRunner:
    """Add ``ups validate``'s arguments to ``parser``; return what runs it."""
    parser.add_argument("config", type=Path)
    parser.add_argument("--nproc", type=count, help="check for this many processes")
    add_overrides(parser)
    return _validate


def _validate(args: argparse.Namespace) -> int:
    """``ups validate``: ``CONFIG: ok``, then a line for each plugin name the config selects
    that a plugin took from a built-in (the config is valid, but not with the built-in)."""
    registry = load_plugins()  # first: the sections of its commands (sweep) are checked too
    config = load_config(args.config, args.override, sections=registry.command_sections())
    check_config(config, registry, args.nproc)
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
