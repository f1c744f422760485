"""The built-in ``simple`` checkpoint backend: one ``torch.save`` file per checkpoint.

Rank 0 writes the (replicated) state to a temporary file in the same folder, fsyncs it and
renames it into place, so a file named ``step-*.pt`` is always complete. Saving and loading are
collectives every rank enters; a failure on rank 0 is raised on every rank. Files load with
``weights_only=True``. ``ups-ckpt`` provides backends for sharded, remote and async checkpoints.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from .collectives import decide
from .context import RunContext
from .files import fsync_dir
from .structure import at_least


@attrs.frozen(kw_only=True)
class SimpleCheckpointOptions:
    """Options of the ``simple`` backend."""

    keep_last: int = attrs.field(default=2, validator=at_least(1))
    """How many checkpoints to keep; older ones are deleted after a save succeeds."""


class SimpleCheckpointer:
    """Keeps checkpoints as ``<run dir>/checkpoints/step-<step>.pt``."""

    def __init__(self, *, ctx: RunContext, directory: Path, options: SimpleCheckpointOptions):
        self.ctx = ctx
        self.folder = directory / "checkpoints"
        self.options = options

    def save(self, state: Mapping[str, Any], *, step: int) -> str:
        """Write rank 0's ``state`` atomically; every rank returns the file's path."""
        path = self.folder / f"step-{step:09d}.pt"
        return decide(self.ctx, lambda: self._write(state, path))

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """Load the newest checkpoint rank 0 sees, on every rank, or ``None`` if there is none."""
        newest = decide(self.ctx, self._newest)
        if newest is None:
            return None
        state = torch.load(newest, map_location="cpu", weights_only=True)
        return int(Path(newest).stem.split("-")[1]), state

    def _write(self, state: Mapping[str, Any], path: Path) -> str:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".pt")
        try:
            with os.fdopen(fd, "wb") as file:
                torch.save(dict(state), file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(self.folder)
        for old in self._committed()[: -self.options.keep_last]:
            old.unlink()
        return str(path)

    def _newest(self) -> str | None:
        committed = self._committed()
        return str(committed[-1]) if committed else None

    def _committed(self) -> list[Path]:
        return sorted(self.folder.glob("step-*.pt"))
