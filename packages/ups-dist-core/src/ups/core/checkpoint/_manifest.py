"""The manifest: the file whose presence commits a checkpoint, and what it says of each file.

A checkpoint is committed once its manifest is written, and written last: a folder or prefix
without one is a save in progress or one that crashed, and is never loaded. The manifest
records each file's size and CRC-32, so that a file damaged since (truncated, overwritten) is
found before it is loaded, and ``resume: latest`` goes back to the newest checkpoint that
verifies.
"""

from __future__ import annotations

import json
import re
from typing import TypeGuard

import attrs
import structlog

from ._serialize import FileRecord

log = structlog.get_logger()

MANIFEST = "COMMIT"
"""The manifest's file name, in the checkpoint's folder (or under its prefix)."""
FORMAT = 2
"""The version of the manifest's format."""

_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)*")


@attrs.frozen(kw_only=True)
class Manifest:
    """The content of a ``COMMIT`` file."""

    step: int
    world_size: int
    files: dict[str, FileRecord]
    """Every file of the checkpoint but the manifest, by its path relative to the checkpoint."""
    saved_at: str = ""
    """When rank 0 committed it, ISO 8601 in UTC."""
    metrics: dict[str, float] = attrs.field(factory=dict)
    """The evaluated values it was saved for, by name (keep-best's monitored value: see
    :mod:`ups.core.checkpoint._best`); ``{}`` for a checkpoint saved for no evaluation."""
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse a manifest; raise ``ValueError`` saying what is wrong when it is not one."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a format-{FORMAT} manifest")
        step, world_size, files = data.get("step"), data.get("world_size"), data.get("files")
        if not (_is_int(step) and step >= 0 and _is_int(world_size) and world_size >= 1):
            raise ValueError("step or world_size is missing or not a valid integer")
        if not isinstance(files, dict) or not all(
            isinstance(name, str) and _FILE_NAME.fullmatch(name) and _is_record(record)
            for name, record in files.items()
        ):
            raise ValueError("files must map relative file paths to {size, crc32}")
        metrics = data.get("metrics", {})
        if not isinstance(metrics, dict) or not all(
            isinstance(name, str) and _is_number(value) for name, value in metrics.items()
        ):
            raise ValueError("metrics must map names to numbers")
        return cls(
            step=step,
            world_size=world_size,
            files={name: FileRecord(r["size"], r["crc32"]) for name, r in files.items()},
            saved_at=str(data.get("saved_at", "")),
            metrics={name: float(value) for name, value in metrics.items()},
        )


def read_committed(text: str | None, name: str, location: str) -> Manifest | None:
    """The manifest of checkpoint ``name`` (``step-<N>``) from its ``COMMIT`` file's ``text``
    (``None``: there is none), or ``None`` when it does not commit that checkpoint: missing,
    unreadable, or naming another step (those two with a warning naming ``location``)."""
    if text is None:
        return None
    try:
        manifest = Manifest.from_json(text)
    except ValueError as error:
        log.warning("unreadable COMMIT; checkpoint ignored", checkpoint=location, error=str(error))
        return None
    if f"step-{manifest.step}" != name:
        log.warning(
            "COMMIT names another step; checkpoint ignored", checkpoint=location, step=manifest.step
        )
        return None
    return manifest


def _is_record(value: object) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"size", "crc32"}
        and all(_is_int(v) and v >= 0 for v in value.values())
    )


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
