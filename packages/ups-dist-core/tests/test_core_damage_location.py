"""A damaged checkpoint's file is named where its storage keeps it: ``<location>/<name>`` in a
folder, and as a :class:`~ups.core.CheckpointStorage` of another layout says
(``location(key, file)``)."""

from __future__ import annotations

from pathlib import Path

import torch
from structlog.testing import capture_logs

from ups.core import Committing, FolderStorage, RunContext, SimpleCheckpointOptions
from ups.core.checkpoint._simple import SimpleCheckpointer


class Described(FolderStorage):
    """The simple layout, its files named as a storage of another layout would name them."""

    def location(self, key: str, file: str | None = None) -> str:
        return super().location(key) if file is None else f"file {file} of {self.path(key)}"


def damage(ckpt: Committing, folder: Path) -> str:
    """The damage the loader finds in step 2's cut-short ``state.pt`` (it loads step 1)."""
    for step in (1, 2):
        ckpt.save({"w": torch.full((4,), float(step))}, step=step, rank_state={})
    state = folder / "checkpoints" / "step-2" / "state.pt"
    state.write_bytes(state.read_bytes()[:50])
    with capture_logs() as logs:
        loaded = ckpt.load_latest()
    assert loaded is not None and loaded.step == 1
    [warning] = [e for e in logs if e["event"].startswith("damaged checkpoint")]
    return str(warning["damage"])


def test_a_damaged_file_is_named_as_its_storage_says(tmp_path: Path) -> None:
    options = SimpleCheckpointOptions(keep_last=2)
    plain = SimpleCheckpointer(ctx=RunContext(), directory=tmp_path / "a", options=options)
    step = tmp_path / "a" / "checkpoints" / "step-2"
    assert damage(plain, tmp_path / "a").startswith(f"{step}/state.pt has 50 bytes")
    folder = tmp_path / "b" / "checkpoints"
    other = Committing(RunContext(), Described(folder), where=f"in {folder}", keep_last=2)
    step = tmp_path / "b" / "checkpoints" / "step-2"
    assert damage(other, tmp_path / "b").startswith(f"file state.pt of {step} has 50 bytes")
