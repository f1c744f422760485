"""``ups plugins``: the plugins found, what each provides, and those blocked or failed."""

from __future__ import annotations

import argparse

from ..plugin._manager import FAMILIES, load_plugins
from ..plugin._records import CommandRunner
from ._common import EXIT_OK


def command(parser: argparse.ArgumentParser) -> CommandRunner:
    """``ups plugins`` takes no arguments; return what runs it."""
    return _plugins


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
