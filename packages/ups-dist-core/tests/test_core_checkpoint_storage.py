"""The commit protocol's storage, ``ups.core.CheckpointStorage``: what the manager refuses to be
built on, and named pointers (``latest`` one of them) through the folder storage."""

from __future__ import annotations

import re
import string
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ups.core import (
    CheckpointError,
    Committing,
    FileRecord,
    FolderStorage,
    RunContext,
    SimpleCheckpointer,
    SimpleCheckpointOptions,
)
from ups.core.checkpoint._commit import STORAGE_METHODS
from ups.core.config._arguments import ArgumentTypeError

NINE = "stage, write, read, commit, checkpoints, remove, set_pointer, read_pointer, location"


def test_the_storage_protocol_has_nine_methods() -> None:
    assert ", ".join(STORAGE_METHODS) == NINE


class Partial:
    """A storage half written: it lacks ``commit`` and ``remove``."""

    def __init__(self, folder: Path) -> None:
        self.inner = FolderStorage(folder)
        for name in STORAGE_METHODS:
            if name not in ("commit", "remove"):
                setattr(self, name, getattr(self.inner, name))


def test_a_storage_lacking_methods_is_refused_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ArgumentTypeError) as raised:
        Committing(RunContext(), Partial(tmp_path), where=f"in {tmp_path}")  # type: ignore[arg-type]
    assert str(raised.value) == (
        "storage: must be a CheckpointStorage (no commit, remove), not a Partial"
    )
    with pytest.raises(TypeError, match=f"no {NINE}\\), not an object"):
        Committing(RunContext(), object(), where="nowhere")  # type: ignore[arg-type]


def test_a_pointer_of_another_name_is_kept_beside_latest(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    ckpt = Committing(RunContext(), FolderStorage(folder), where=f"in {folder}", keep_last=None)
    for step in (1, 2, 3):
        ckpt.save({"w": torch.full((2,), float(step))}, step=step, rank_state={})
    ckpt.storage.set_pointer("best", "step-2")
    assert ckpt.storage.read_pointer("best") == "step-2\n"
    assert (folder / "best").read_text() == "step-2\n"  # the file layout of latest's
    assert (folder / "latest").read_text() == "step-3\n"
    loaded = ckpt.load_latest()
    assert loaded is not None and loaded.step == 3  # loading follows latest only
    assert ckpt.storage.read_pointer("worst") is None


names = st.text(string.ascii_lowercase, min_size=1, max_size=6)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(names, st.integers(0, 10**6)), max_size=12))
def test_each_pointer_names_what_it_was_set_to_last(sets: list[tuple[str, int]]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        storage = FolderStorage(Path(folder))
        for name, step in sets:
            storage.set_pointer(name, f"step-{step}")
        last = dict(sets)
        for name, step in last.items():
            assert (storage.read_pointer(name) or "").strip() == f"step-{step}"
        assert sorted(p.name for p in Path(folder).iterdir()) == sorted(last)  # nothing beside


class Losing(FolderStorage):
    """A storage that loses the last byte of every file it writes."""

    def write(self, key: str, file: str, obj: Mapping[str, Any]) -> FileRecord:
        record = super().write(key, file, obj)
        path = self.path(key) / file
        path.write_bytes(path.read_bytes()[:-1])
        return record


def test_a_file_not_there_at_its_size_fails_the_save_and_leaves_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    ckpt = Committing(RunContext(), Losing(folder), where=f"in {folder}", keep_last=None)
    with pytest.raises(CheckpointError) as raised:
        ckpt.save({"w": torch.ones(2)}, step=1, rank_state={})
    said = re.fullmatch(
        rf"{re.escape(str(folder))}/\.tmp-step-1-[0-9a-f]{{8}}/rank-0\.pt is not there with the "
        rf"(\d+) bytes written \(found: (\d+)\): does every rank reach the same storage in "
        rf"{re.escape(str(folder))}\?",
        str(raised.value),
    )
    assert said is not None and int(said[2]) == int(said[1]) - 1
    assert sorted(p.name for p in folder.iterdir()) == []  # staged, then removed
    assert ckpt.load_latest() is None


def test_a_write_that_fails_fails_the_save_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    """The public seam of a storage's tests: ``FolderStorage.write_file``, given to the
    constructor or set on a built checkpointer's storage."""
    ckpt = SimpleCheckpointer(
        ctx=RunContext(), directory=tmp_path, options=SimpleCheckpointOptions()
    )
    ckpt.save({"w": torch.ones(2)}, step=1, rank_state={})
    real_write = ckpt.storage.write_file
    written: list[str] = []

    def disk_full(path: Path, obj: Mapping[str, Any]) -> FileRecord:
        written.append(path.name)
        if path.name == "rank-0.pt":
            raise OSError("disk full (simulated)")
        return real_write(path, obj)

    ckpt.storage.write_file = disk_full
    with pytest.raises(CheckpointError, match=r"^saving checkpoint step 2 failed on rank 0: "):
        ckpt.save({"w": torch.zeros(2)}, step=2, rank_state={})
    assert "rank-0.pt" in written
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-1"]
    loaded = ckpt.load_latest()
    assert loaded is not None and loaded.step == 1
    # Given to the constructor: every file goes through it.
    seen: list[str] = []

    def counting(path: Path, obj: Mapping[str, Any]) -> FileRecord:
        seen.append(path.name)
        return real_write(path, obj)

    storage = FolderStorage(tmp_path / "other", write_file=counting)
    Committing(RunContext(), storage, where="in other", keep_last=None).save(
        {"w": torch.ones(2)}, step=1, rank_state={}
    )
    assert sorted(seen) == ["rank-0.pt", "state.pt"]
