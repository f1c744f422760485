"""Retention with a save in flight: a background (``async_save``) checkpointer's save is never
deleted by another checkpointer's retention. The rule itself (``expired``) and what it deletes
in a folder are tested in ups-dist-core (``test_core_retention.py``)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ups.ckpt import InBackground, LocalCheckpointer, LocalCheckpointOptions
from ups.ckpt.plugin import local_backend
from ups.core import FileRecord, RunContext

SINGLE = RunContext()


def visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_retention_never_deletes_a_save_in_flight_nor_what_latest_names(tmp_path: Path) -> None:
    """An ``async_save`` checkpointer's save is held while it writes; another checkpointer of
    the folder commits three saves with ``keep_last=1`` meanwhile. Its retention deletes only
    committed checkpoints: the save in flight then commits, and ``latest`` names it."""
    folder = tmp_path / "checkpoints"
    other = LocalCheckpointer(
        ctx=SINGLE, directory=tmp_path, options=LocalCheckpointOptions(keep_last=1)
    )
    other.save({"by": "other", "step": 1}, step=1, rank_state={})  # it sweeps now, not later
    background = local_backend(
        ctx=SINGLE, directory=tmp_path, options=LocalCheckpointOptions(keep_last=1, async_save=True)
    )
    entered, gate = threading.Event(), threading.Event()
    assert isinstance(background, InBackground)
    assert isinstance(background.inner, LocalCheckpointer)
    written = background.inner.storage
    real_write = written.write_file

    def held(path: Path, obj: Mapping[str, Any]) -> FileRecord:
        if path.parent.name.startswith(".tmp-step-2-"):
            entered.set()
            assert gate.wait(30), "never released"
        return real_write(path, obj)

    written.write_file = held
    background.save({"by": "background", "w": torch.ones(2)}, step=2, rank_state={})
    try:
        assert entered.wait(30), "the background save never began writing"
        [in_flight] = folder.glob(".tmp-step-2-*")
        for step in (3, 4, 5):
            other.save({"by": "other", "step": step}, step=step, rank_state={})
            assert visible(folder) == sorted([in_flight.name, "latest", f"step-{step}"])
            assert (folder / "latest").read_text() == f"step-{step}\n"
    finally:
        gate.set()
    background.wait()
    # Committed; `latest` names it, and its own retention keeps it (protected) and step-5
    # (the newest).
    assert visible(folder) == ["latest", "step-2", "step-5"]
    assert (folder / "latest").read_text() == "step-2\n"
    loaded = background.load_latest()
    assert loaded is not None and loaded.step == 2 and loaded.state["by"] == "background"
    assert torch.equal(loaded.state["w"], torch.ones(2))
