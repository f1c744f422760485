"""The commit protocol over a folder (the built-in ``simple`` backend), in one process: the
committed layout, what is never loaded (a leftover ``.tmp``, an uncommitted or torn folder, a
``COMMIT`` of another step, damaged or missing files, flipped bytes the CRC-32s find), the
sweep of what crashed saves left, retention, and refusal of unsafe pickles. Crashes at each
stage of a save, on two ranks, are ups-ckpt's ``test_ckpt_faults.py`` (its ``local`` backend's
each rank writing its own file)."""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from ups.core import (
    CheckpointError,
    RunContext,
    SimpleCheckpointer,
    SimpleCheckpointOptions,
    UnsafeCheckpointError,
)

SINGLE = RunContext()
OPTIONS = SimpleCheckpointOptions(keep_last=2)


def checkpointer(
    directory: Path, keep_last: int | None = 3, ctx: RunContext = SINGLE
) -> SimpleCheckpointer:
    return SimpleCheckpointer(
        ctx=ctx, directory=directory, options=SimpleCheckpointOptions(keep_last=keep_last)
    )


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def listing(folder: Path) -> list[str]:
    """The folder's entries, each random suffix shown as ``*``."""
    return sorted(re.sub(r"-[0-9a-f]{8}$", "-*", p.name) for p in folder.iterdir())


# ---------------------------------------------------------------------------------------------
# One process


def test_save_writes_the_committed_layout(tmp_path: Path) -> None:
    location = checkpointer(tmp_path).save(
        {"step": 7, "w": torch.ones(2)}, step=7, rank_state={"mine": torch.zeros(1)}
    )
    folder = tmp_path / "checkpoints"
    assert location == str(folder / "step-7")
    assert names(folder / "step-7") == ["COMMIT", "rank-0.pt", "state.pt"]
    assert (folder / "latest").read_text() == "step-7\n"
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]
    assert torch.equal(torch.load(folder / "step-7" / "rank-0.pt")["mine"], torch.zeros(1))
    [committed] = checkpointer(tmp_path).committed()
    assert committed.step == 7 and committed.manifest.world_size == 1
    assert set(committed.manifest.files) == {"rank-0.pt", "state.pt"}


def test_load_latest_hands_back_this_ranks_state(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path)
    assert ckpt.load_latest() is None
    ckpt.save({"w": torch.ones(3)}, step=4, rank_state={"gen": torch.tensor([1, 2])})
    loaded = ckpt.load_latest()
    assert loaded is not None
    assert loaded.step == 4 and loaded.location == str(tmp_path / "checkpoints" / "step-4")
    assert torch.equal(loaded.state["w"], torch.ones(3))
    assert loaded.rank_state is not None
    assert torch.equal(loaded.rank_state["gen"], torch.tensor([1, 2]))
    ckpt.wait()  # nothing in flight: returns at once


def test_leftover_temporary_and_uncommitted_folders_are_ignored(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path, keep_last=1)
    ckpt.save({"w": torch.zeros(2)}, step=1, rank_state={})
    folder = tmp_path / "checkpoints"
    # A save that crashed before the rename (even after writing COMMIT) ...
    leftover = folder / ".tmp-step-9-deadbeef"
    leftover.mkdir()
    torch.save({"w": torch.full((2,), 9.0)}, leftover / "state.pt")
    (leftover / "COMMIT").write_text((folder / "step-1" / "COMMIT").read_text())
    # ... and a step folder that was never committed, which `latest` even names.
    uncommitted = folder / "step-8"
    uncommitted.mkdir()
    torch.save({"w": torch.full((2,), 8.0)}, uncommitted / "state.pt")
    (folder / "latest").write_text("step-8\n")

    with structlog.testing.capture_logs() as logs:
        loaded = ckpt.load_latest()
    assert loaded is not None
    assert loaded.step == 1 and torch.equal(loaded.state["w"], torch.zeros(2))
    latest = str(folder / "step-8")  # a location, as the fsspec backend's message gives it
    assert {"event": "'latest' names no committed checkpoint", "latest": latest}.items() <= (
        logs[0].items()
    )

    # This instance swept at its first save: a .tmp folder made since may be a save in flight,
    # and retention (keep_last=1) does not touch it, nor the uncommitted folder.
    ckpt.save({"w": torch.ones(2)}, step=2, rank_state={})
    assert names(folder) == [".tmp-step-9-deadbeef", "latest", "step-2", "step-8"]


def test_the_first_save_of_a_checkpointer_removes_what_crashed_saves_left(tmp_path: Path) -> None:
    checkpointer(tmp_path).save({"w": torch.zeros(2)}, step=1, rank_state={})
    folder = tmp_path / "checkpoints"
    (folder / ".tmp-step-2-0badc0de").mkdir()
    (folder / ".tmp-step-2-0badc0de" / "state.pt").write_bytes(b"half")
    (folder / ".trash-step-0-0badc0de").mkdir()
    (folder / ".trash-step-0-0badc0de" / "rank-0.pt").write_bytes(b"half deleted")
    assert checkpointer(tmp_path).load_latest() is not None  # loading leaves them alone
    assert len(names(folder)) == 4
    checkpointer(tmp_path).save({"w": torch.ones(2)}, step=2, rank_state={})
    assert names(folder) == ["latest", "step-1", "step-2"]


def test_a_commit_naming_another_step_is_not_committed(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path)
    ckpt.save({"w": torch.zeros(1)}, step=3, rank_state={})
    folder = tmp_path / "checkpoints"
    os.rename(folder / "step-3", folder / "step-4")
    (folder / "latest").write_text("step-4\n")
    with structlog.testing.capture_logs() as logs:
        assert ckpt.load_latest() is None
    assert any(log["event"] == "COMMIT names another step; checkpoint ignored" for log in logs)


def test_an_unreadable_commit_is_not_committed(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path)
    ckpt.save({"w": torch.zeros(1)}, step=1, rank_state={})
    ckpt.save({"w": torch.ones(1)}, step=2, rank_state={})
    commit = tmp_path / "checkpoints" / "step-2" / "COMMIT"
    commit.write_text(commit.read_text()[:40])  # torn
    with structlog.testing.capture_logs() as logs:
        loaded = ckpt.load_latest()
    assert loaded is not None and loaded.step == 1
    assert any(log["event"] == "unreadable COMMIT; checkpoint ignored" for log in logs)


def test_retention_keeps_the_newest_and_what_latest_names(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path, keep_last=2)
    folder = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        ckpt.save({"step": step}, step=step, rank_state={})
    assert names(folder) == ["latest", "step-3", "step-4"]
    # Resumed from step 2 and saved step 3 again: `latest` names step-3; keep_last=1 keeps the
    # newest (step-4) and never deletes the checkpoint `latest` names.
    ckpt = checkpointer(tmp_path, keep_last=1)
    ckpt.save({"step": 3, "again": True}, step=3, rank_state={})
    assert names(folder) == ["latest", "step-3", "step-4"]
    loaded = ckpt.load_latest()
    assert loaded is not None
    assert loaded.step == 3 and loaded.state["again"] is True
    ckpt.save({"step": 5}, step=5, rank_state={})
    assert names(folder) == ["latest", "step-5"]


def test_keep_last_none_keeps_everything(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path, keep_last=None)
    for step in range(1, 6):
        ckpt.save({"step": step}, step=step, rank_state={})
    assert [c.step for c in ckpt.committed()] == [1, 2, 3, 4, 5]


def test_a_damaged_checkpoint_is_reported_not_loaded(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path)
    ckpt.save({"w": torch.zeros(100)}, step=1, rank_state={})
    folder = tmp_path / "checkpoints"
    state_file = folder / "step-1" / "state.pt"
    with open(state_file, "r+b") as file:
        file.truncate(state_file.stat().st_size // 2)
    with (
        structlog.testing.capture_logs() as logs,
        pytest.raises(CheckpointError, match=rf"no checkpoint in {folder} verifies"),
    ):
        ckpt.load_latest()
    [warning] = logs
    assert warning["checkpoint"] == str(folder / "step-1")
    assert warning["damage"].startswith(f"{state_file} has {state_file.stat().st_size} bytes")
    assert "COMMIT says" in warning["damage"]


def test_a_missing_file_is_damage(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path)
    ckpt.save({"w": torch.zeros(1)}, step=1, rank_state={})
    ckpt.save({"w": torch.ones(1)}, step=2, rank_state={})
    rank_file = tmp_path / "checkpoints" / "step-2" / "rank-0.pt"
    rank_file.unlink()
    with structlog.testing.capture_logs() as logs:
        loaded = ckpt.load_latest()
    assert loaded is not None and loaded.step == 1
    assert logs[0]["damage"] == f"{rank_file} is missing"


def test_a_bad_step_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="step must be an integer >= 0, got -1"):
        checkpointer(tmp_path).save({}, step=-1, rank_state={})
    assert checkpointer(tmp_path).load_latest() is None


# ---------------------------------------------------------------------------------------------
# Unsafe pickles


class RunsCode:
    """Unpickling this runs a shell command: exactly what must never happen on load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused_on_load(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path)
    ckpt.save({"w": torch.zeros(1)}, step=1, rank_state={})
    marker = tmp_path / "pwned"
    state_file = tmp_path / "checkpoints" / "step-1" / "state.pt"
    state_file.unlink()
    torch.save({"w": RunsCode(marker)}, state_file)
    commit = tmp_path / "checkpoints" / "step-1" / "COMMIT"
    manifest = json.loads(commit.read_text())
    data = state_file.read_bytes()  # a consistent, hostile checkpoint
    manifest["files"]["state.pt"] = {"size": len(data), "crc32": zlib.crc32(data)}
    commit.write_text(json.dumps(manifest))

    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load .*state\.pt") as caught:
        ckpt.load_latest()
    assert "system" in str(caught.value)  # names what it refused
    assert not marker.exists()


def test_a_state_that_could_not_be_loaded_back_is_not_committed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(UnsafeCheckpointError, match="weights_only=True refuses"):
        checkpointer(tmp_path).save({"w": RunsCode(marker)}, step=1, rank_state={})
    assert not marker.exists()
    assert not (tmp_path / "checkpoints").exists() or names(tmp_path / "checkpoints") == []


def test_a_rank_state_that_could_not_be_loaded_back_is_not_committed(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path)
    ckpt.save({"w": torch.zeros(1)}, step=1, rank_state={})
    with pytest.raises(UnsafeCheckpointError, match="saving checkpoint step 2 failed on rank 0"):
        ckpt.save({"w": torch.ones(1)}, step=2, rank_state={"x": RunsCode(tmp_path / "pwned")})
    assert names(tmp_path / "checkpoints") == ["latest", "step-1"]  # its .tmp folder removed


def test_the_next_save_sweeps_a_temporary_latest_left_by_a_crash(tmp_path: Path) -> None:
    ckpt = SimpleCheckpointer(ctx=RunContext(), directory=tmp_path, options=OPTIONS)
    ckpt.save({"step": 1}, step=1, rank_state={})
    folder = tmp_path / "checkpoints"
    (folder / ".latest-0badc0de").write_text("step-2\n")  # as the stage "replacing latest" leaves
    SimpleCheckpointer(ctx=RunContext(), directory=tmp_path, options=OPTIONS).save(
        {"step": 2}, step=2, rank_state={}
    )
    assert listing(folder) == ["latest", "step-1", "step-2"]


# ---------------------------------------------------------------------------------------------
# Bytes damaged after the commit: found by the CRC-32s in COMMIT


def flip_a_data_byte(path: Path, tensor: torch.Tensor) -> None:
    """Flip one byte inside ``tensor``'s data in the file ``path``: same size, and torch still
    loads it (with a wrong value), so only the manifest's CRC-32 can tell."""
    data = bytearray(path.read_bytes())
    start = data.find(tensor.numpy().tobytes())
    assert start >= 0
    data[start + tensor.nbytes // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert not torch.equal(torch.load(path, weights_only=True)["w"], tensor)


def _two_checkpoints(directory: Path) -> tuple[SimpleCheckpointer, torch.Tensor]:
    ckpt = SimpleCheckpointer(ctx=RunContext(), directory=directory, options=OPTIONS)
    w = torch.arange(1000, dtype=torch.float32)
    for step in (1, 2):
        ckpt.save({"w": w + step}, step=step, rank_state={"w": w - step})
    return ckpt, w


@pytest.mark.parametrize("name", ["state.pt", "rank-0.pt"])
def test_a_flipped_byte_is_found_and_the_older_checkpoint_loads(tmp_path: Path, name: str) -> None:
    ckpt, w = _two_checkpoints(tmp_path)
    damaged = tmp_path / "checkpoints" / "step-2" / name
    size = damaged.stat().st_size
    flip_a_data_byte(damaged, w + 2 if name == "state.pt" else w - 2)
    assert damaged.stat().st_size == size
    with structlog.testing.capture_logs() as logs:
        loaded = ckpt.load_latest()
    assert loaded is not None and loaded.step == 1
    assert loaded.rank_state is not None
    assert torch.equal(loaded.state["w"], w + 1) and torch.equal(loaded.rank_state["w"], w - 1)
    [warning] = logs
    assert warning["event"] == "damaged checkpoint skipped: loading an older one"
    assert warning["log_level"] == "warning"
    assert warning["checkpoint"] == str(damaged.parent)
    assert re.fullmatch(
        rf"{re.escape(str(damaged))} has {size} bytes, CRC-32 [0-9a-f]{{8}}; "
        rf"COMMIT says {size} bytes, CRC-32 [0-9a-f]{{8}}",
        warning["damage"],
    )


def test_when_no_checkpoint_verifies_the_error_names_the_folder(tmp_path: Path) -> None:
    ckpt, w = _two_checkpoints(tmp_path)
    folder = tmp_path / "checkpoints"
    for step in (1, 2):
        flip_a_data_byte(folder / f"step-{step}" / "state.pt", w + step)
    with (
        structlog.testing.capture_logs() as logs,
        pytest.raises(
            CheckpointError,
            match=rf"no checkpoint in {re.escape(str(folder))} verifies .*2 damaged",
        ),
    ):
        ckpt.load_latest()
    assert [log["checkpoint"] for log in logs] == [str(folder / "step-2"), str(folder / "step-1")]
