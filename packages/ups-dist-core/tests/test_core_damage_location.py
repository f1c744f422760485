"""A damaged checkpoint's file is named where its storage keeps it: ``<location>/<name>`` by
default, and as a :class:`~ups.core.Committing` storage with another layout says
(``_location_of_file``)."""

from __future__ import annotations

from pathlib import Path

import torch
from structlog.testing import capture_logs

from ups.core import RunContext, SimpleCheckpointOptions
from ups.core.simple_checkpoint import SimpleCheckpointer


class Described(SimpleCheckpointer):
    """The simple layout, its files named as a storage of another layout would name them."""

    def _location_of_file(self, where: Path, name: str) -> str:
        return f"file {name} of {self._location_of(where)}"


def damage(ckpt: SimpleCheckpointer, folder: Path) -> str:
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
    other = Described(ctx=RunContext(), directory=tmp_path / "b", options=options)
    step = tmp_path / "b" / "checkpoints" / "step-2"
    assert damage(other, tmp_path / "b").startswith(f"file state.pt of {step} has 50 bytes")
