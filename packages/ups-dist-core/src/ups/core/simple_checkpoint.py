"""The built-in ``simple`` checkpoint backend: one ``torch.save`` file per checkpoint.

Rank 0 gathers every rank's own state and writes it with the (replicated) state to a temporary
file in the same folder, fsyncs it and renames it into place, so a file named ``step-*.pt`` is
always complete. Saving and loading are
collectives every rank enters; a failure on rank 0 is raised on every rank. Files load with
``weights_only=True``: one that would run code is refused, naming it; one damaged since (a
truncated or unreadable file) is skipped with a warning naming it, for the newest that reads.
``ups-ckpt`` provides backends for sharded, remote and async checkpoints.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import structlog
import torch
import torch.distributed as dist

from .collectives import decide
from .context import RunContext
from .errors import UsageError
from .files import fsync_dir
from .records import Loaded
from .structure import at_least

log = structlog.get_logger()


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

    def save(self, state: Mapping[str, Any], *, step: int, rank_state: Mapping[str, Any]) -> str:
        """Write rank 0's ``state`` and every rank's ``rank_state`` atomically; every rank
        returns the file's path."""
        path = self.folder / f"step-{step:09d}.pt"
        ranks: list[object] = [dict(rank_state)]
        if self.ctx.distributed:
            ranks = [None] * self.ctx.world_size if self.ctx.is_main else []
            dist.gather_object(dict(rank_state), ranks if self.ctx.is_main else None, dst=0)
        return decide(self.ctx, lambda: self._write({"state": dict(state), "ranks": ranks}, path))

    def load_latest(self) -> Loaded | None:
        """Load the newest checkpoint rank 0 can read, on every rank, or ``None`` if there is
        none.

        :raises UsageError: (on every rank) naming a checkpoint that would run code to load.
        """
        newest = decide(self.ctx, self._newest_readable)
        if newest is None:
            return None
        saved = torch.load(newest, map_location="cpu", weights_only=True)
        ranks = saved["ranks"]
        return Loaded(
            step=int(Path(newest).stem.split("-")[1]),
            state=saved["state"],
            rank_state=ranks[self.ctx.rank] if len(ranks) == self.ctx.world_size else None,
            location=newest,
        )

    def wait(self) -> None:
        """Nothing to wait for: :meth:`save` returns once the file is in place."""

    def _write(self, state: dict[str, Any], path: Path) -> str:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".pt")
        try:
            with os.fdopen(fd, "wb") as file:
                torch.save(state, file)
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

    def _newest_readable(self) -> str | None:
        """The newest checkpoint whose structure loads with ``weights_only=True`` (tensor
        data memory-mapped, not read); damaged ones are skipped, with a warning."""
        for path in reversed(self._committed()):
            try:
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except pickle.UnpicklingError:
                raise UsageError(
                    f"refusing to load {path}: it holds objects that loading would have to run "
                    "code for (checkpoints load with weights_only=True)"
                ) from None
            except Exception as error:
                log.warning("damaged checkpoint skipped", checkpoint=str(path), error=str(error))
                continue
            return str(path)
        return None

    def _committed(self) -> list[Path]:
        return sorted(self.folder.glob("step-*.pt"))
