"""The launch record: ``<run.output_dir>/<run.name>/launch.json``, written by ``ups launch``.

It keeps what ``ups status``, ``ups logs`` and ``ups cancel`` need to find a job again from a
later shell, whatever launcher started it: the launcher's name and its options as configured
(to build the launcher again), the handle its ``submit`` returned, and the request::

    {
      "format": 1,
      "launcher": "local",
      "options": {"cancel_grace_s": 5},
      "handle": "/home/me/project/runs/tiny",
      "request": {"config": "run.yaml", "nproc_per_node": 2, "nnodes": 1,
                  "overrides": ["training.lr=3e-4"], "run_dir": "runs"},
      "cwd": "/home/me/project",
      "submitted": "2025-01-31T12:00:00+00:00"
    }

Relative paths of the request are relative to ``cwd``. The record never holds a secret:
launchers take keys from the environment or from a file the user names, so their options hold
only the variable's name or the file's path.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import attrs

from ..checkpoint._files import write_atomically
from ..config._errors import ConfigError, UsageError
from ..plugin._manager import Registry
from ..plugin._records import Launcher, LaunchRequest

FORMAT = 1
RECORD_FILE = "launch.json"
DEFAULT_RUN_DIR = Path("runs")
"""Where ``ups status RUN`` looks for a run given by name (relative to the working directory)."""
HELD = {
    "STOPPED": "the job has ended, but its machines are kept, and billed, until "
    "`ups cancel {run}` deletes them",
}
"""Ended states in which the job still holds machines that bill, with what to tell the user
(``{run}``: the run as the user named it). ``ups launch`` does not replace such a job's record,
which is what ``ups cancel`` needs to end the bill."""


@attrs.frozen(kw_only=True)
class LaunchRecord:
    """The content of ``launch.json`` (see the module doc)."""

    launcher: str
    options: dict[str, Any]
    handle: str
    request: LaunchRequest
    cwd: str
    submitted: str
    """ISO 8601, UTC."""
    format: int = FORMAT

    def to_json(self) -> str:
        request = self.request
        data = {
            "format": self.format,
            "launcher": self.launcher,
            "options": self.options,
            "handle": self.handle,
            "request": {
                "config": str(request.config),
                "nproc_per_node": request.nproc_per_node,
                "nnodes": request.nnodes,
                "overrides": list(request.overrides),
                "run_dir": str(request.run_dir),
            },
            "cwd": self.cwd,
            "submitted": self.submitted,
        }
        try:
            return json.dumps(data, indent=2) + "\n"
        except (TypeError, ValueError) as error:
            raise UsageError(f"launch.options: cannot be kept in {RECORD_FILE}: {error}") from None

    @classmethod
    def read(cls, path: Path) -> LaunchRecord:
        """Read a ``launch.json``; a damaged one is a :class:`UsageError` naming it."""
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
            request = data["request"]
            options = data["options"]
            if not isinstance(options, dict):
                raise TypeError(f"options is {type(options).__name__}, not a mapping")
            return cls(
                launcher=_text(data["launcher"]),
                options=options,
                handle=_text(data["handle"]),
                request=LaunchRequest(
                    config=Path(_text(request["config"])),
                    nproc_per_node=int(request["nproc_per_node"]),
                    nnodes=int(request["nnodes"]),
                    overrides=tuple(_text(o) for o in request["overrides"]),
                    run_dir=Path(_text(request["run_dir"])),
                ),
                cwd=_text(data["cwd"]),
                submitted=_text(data["submitted"]),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise UsageError(f"{path}: not a readable launch record ({error})") from None

    def write(self, folder: Path) -> Path:
        """Write the record into ``folder`` (created if needed), atomically; return its path."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / RECORD_FILE
        write_atomically(path, self.to_json())
        return path


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def new_record(
    launcher: str, options: Mapping[str, Any], handle: str, request: LaunchRequest
) -> LaunchRecord:
    """The record of a job submitted just now from the working directory."""
    return LaunchRecord(
        launcher=launcher,
        options=dict(options),
        handle=handle,
        request=request,
        cwd=os.getcwd(),
        submitted=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def find_record(run: str) -> Path:
    """The ``launch.json`` of ``run``: a run's name (``runs/<run>/launch.json`` under the working
    directory), its folder, or the record's path.

    :raises UsageError: naming ``run`` and where it was looked for, when there is none.
    """
    path = Path(run)
    candidates = [path] if path.name == RECORD_FILE else []
    candidates.append(path / RECORD_FILE)
    if not path.is_absolute() and len(path.parts) == 1:
        candidates.append(DEFAULT_RUN_DIR / path / RECORD_FILE)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise UsageError(
        f"no launched run {run!r}: no launch record at {looked}; pass a run's name, "
        "its folder or its launch.json"
    )


def held_note(state: str, run: str) -> str | None:
    """What to tell the user of a job of ``run`` in ``state`` when the job has ended but still
    holds machines that bill (see :data:`HELD`); ``None`` for any other state."""
    note = HELD.get(state)
    return None if note is None else note.format(run=run)


def build_launcher(
    registry: Registry, name: str, options: Mapping[str, Any], where: str = "launch"
) -> Launcher:
    """The launcher ``name`` built with ``options``, checked through ``registry``.

    :param where: what selected it, for error messages: the config section ``launch``, or a
        record's path.
    :raises UsageError: an unknown (not installed) launcher, or options it refuses.
    """
    try:
        record, built = registry.select("launcher", name, options, "launch")
    except ConfigError as error:
        if where == "launch":
            raise
        raise UsageError(f"{where}: launcher {name!r}: {error}") from None
    launcher: Launcher = record.factory(options=built)
    return launcher
