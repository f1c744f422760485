"""The ``local`` backend: commit protocol, loading, retention and refusal of unsafe pickles.

Multi-process tests run on real gloo process groups (``ups.core.testing.run_ranks``); their
rank functions are module-level so the spawned processes can import them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ups.ckpt
from ups.ckpt import (
    RNG_KEY,
    CheckpointError,
    LocalCheckpointer,
    LocalCheckpointOptions,
    UnsafeCheckpointError,
    restore_rng,
)
from ups.core import RunContext
from ups.core.testing import run_ranks

SINGLE = RunContext()


def checkpointer(
    directory: Path, keep_last: int = 3, ctx: RunContext = SINGLE
) -> LocalCheckpointer:
    return LocalCheckpointer(
        ctx=ctx, directory=directory, options=LocalCheckpointOptions(keep_last=keep_last)
    )


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_code_under_test_is_this_tree() -> None:
    src = Path(__file__).resolve().parents[1] / "src"
    assert Path(ups.ckpt.__file__).resolve().is_relative_to(src)


# ---------------------------------------------------------------------------------------------
# Two real ranks


def _round_trip(ctx: RunContext, directory: str) -> dict[str, Any]:
    ckpt = checkpointer(Path(directory), ctx=ctx)
    empty = ckpt.load_latest()
    torch.manual_seed(100 + ctx.rank)
    torch.rand(3)
    weights = torch.arange(6.0).reshape(2, 3) * (ctx.rank + 1)  # only rank 0's is kept
    ckpt.save({"model": {"w": weights}, "step": 5}, step=5)
    torch.rand(3)
    rng_at_save = torch.get_rng_state()
    location = ckpt.save({"model": {"w": weights + 1}, "step": 10}, step=10)
    expected_next = torch.rand(4)
    torch.manual_seed(999)  # scramble, then restore from the checkpoint
    loaded = ckpt.load_latest()
    assert loaded is not None
    step, state = loaded
    restore_rng(state)
    return {
        "empty": empty,
        "location": location,
        "step": step,
        "w": state["model"]["w"],
        "rng_matches": torch.equal(state[RNG_KEY]["torch"], rng_at_save),
        "next_matches": torch.equal(torch.rand(4), expected_next),
    }


@pytest.mark.slow
def test_two_ranks_save_and_load_round_trip(tmp_path: Path) -> None:
    results = run_ranks(_round_trip, 2, str(tmp_path))
    folder = tmp_path / "checkpoints"
    for rank, result in enumerate(results):
        assert result["empty"] is None
        assert result["location"] == str(folder / "step-10")
        assert result["step"] == 10
        assert torch.equal(result["w"], torch.arange(6.0).reshape(2, 3) + 1)  # rank 0's state
        assert result["rng_matches"], f"rank {rank} got another rank's RNG state"
        assert result["next_matches"]
    assert names(folder) == ["latest", "step-10", "step-5"]
    assert (folder / "latest").read_text() == "step-10\n"
    commit = json.loads((folder / "step-10" / "COMMIT").read_text())
    assert commit["step"] == 10 and commit["world_size"] == 2
    assert set(commit["files"]) == {"state.pt", "rank-0.pt", "rank-1.pt"}
    for name, size in commit["files"].items():
        assert (folder / "step-10" / name).stat().st_size == size
    rank_states = [torch.load(folder / "step-10" / f"rank-{r}.pt") for r in (0, 1)]
    assert not torch.equal(rank_states[0]["rng"]["torch"], rank_states[1]["rng"]["torch"])

    # Loaded by a world of another size: the state, without per-rank RNG states.
    loaded = checkpointer(tmp_path).load_latest()
    assert loaded is not None
    assert loaded[0] == 10 and RNG_KEY not in loaded[1]


class FailsOnRankOne(LocalCheckpointer):
    def rank_state(self) -> dict[str, Any]:
        if self.ctx.rank == 1:
            raise OSError("disk full (simulated)")
        return super().rank_state()


def _one_rank_fails(ctx: RunContext, directory: str) -> str:
    options = LocalCheckpointOptions()
    checkpointer(Path(directory), ctx=ctx).save({"step": 1}, step=1)
    failing = FailsOnRankOne(ctx=ctx, directory=Path(directory), options=options)
    try:
        failing.save({"step": 2}, step=2)
    except CheckpointError as error:
        message = str(error)
    else:
        raise AssertionError(f"rank {ctx.rank}: the failed save did not raise")
    # Every rank is still in step with the others: the next collective works.
    loaded = checkpointer(Path(directory), ctx=ctx).load_latest()
    assert loaded is not None and loaded[0] == 1
    return message


@pytest.mark.slow
def test_a_failure_on_one_rank_raises_on_every_rank_and_commits_nothing(tmp_path: Path) -> None:
    messages = run_ranks(_one_rank_fails, 2, str(tmp_path))
    for message in messages:
        assert "saving checkpoint step 2 failed on rank 1" in message
        assert "disk full (simulated)" in message
    assert names(tmp_path / "checkpoints") == ["latest", "step-1"]  # no step-2, no .tmp left


# ---------------------------------------------------------------------------------------------
# One process


def test_save_writes_the_committed_layout(tmp_path: Path) -> None:
    location = checkpointer(tmp_path).save({"step": 7, "w": torch.ones(2)}, step=7)
    folder = tmp_path / "checkpoints"
    assert location == str(folder / "step-7")
    assert names(folder / "step-7") == ["COMMIT", "rank-0.pt", "state.pt"]
    assert (folder / "latest").read_text() == "step-7\n"
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]


def test_leftover_temporary_and_uncommitted_folders_are_ignored(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path, keep_last=1)
    ckpt.save({"w": torch.zeros(2)}, step=1)
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

    loaded = ckpt.load_latest()
    assert loaded is not None
    step, state = loaded
    assert step == 1 and torch.equal(state["w"], torch.zeros(2))

    ckpt.save({"w": torch.ones(2)}, step=2)  # retention (keep_last=1) must not touch them
    assert names(folder) == [".tmp-step-9-deadbeef", "latest", "step-2", "step-8"]


def test_a_commit_naming_another_step_is_not_committed(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path)
    ckpt.save({"w": torch.zeros(1)}, step=3)
    folder = tmp_path / "checkpoints"
    os.rename(folder / "step-3", folder / "step-4")
    (folder / "latest").write_text("step-4\n")
    assert ckpt.load_latest() is None


def test_retention_keeps_the_newest_and_what_latest_names(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path, keep_last=2)
    folder = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        ckpt.save({"step": step}, step=step)
    assert names(folder) == ["latest", "step-3", "step-4"]
    # Resumed from step 2 and saved step 3 again: `latest` names step-3; keep_last=1 keeps the
    # newest (step-4) and never deletes the checkpoint `latest` names.
    ckpt = checkpointer(tmp_path, keep_last=1)
    ckpt.save({"step": 3, "again": True}, step=3)
    assert names(folder) == ["latest", "step-3", "step-4"]
    loaded = ckpt.load_latest()
    assert loaded is not None
    assert loaded[0] == 3 and loaded[1]["again"] is True
    ckpt.save({"step": 5}, step=5)
    assert names(folder) == ["latest", "step-5"]


def test_a_damaged_checkpoint_is_reported_not_loaded(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path)
    ckpt.save({"w": torch.zeros(100)}, step=1)
    state_file = tmp_path / "checkpoints" / "step-1" / "state.pt"
    with open(state_file, "r+b") as file:
        file.truncate(state_file.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"state\.pt has \d+ bytes but COMMIT says"):
        ckpt.load_latest()


def test_the_reserved_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=RNG_KEY):
        checkpointer(tmp_path).save({RNG_KEY: 1}, step=1)
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
    ckpt.save({"w": torch.zeros(1)}, step=1)
    marker = tmp_path / "pwned"
    state_file = tmp_path / "checkpoints" / "step-1" / "state.pt"
    state_file.unlink()
    torch.save({"w": RunsCode(marker)}, state_file)
    commit = tmp_path / "checkpoints" / "step-1" / "COMMIT"
    manifest = json.loads(commit.read_text())
    manifest["files"]["state.pt"] = state_file.stat().st_size  # a consistent, hostile checkpoint
    commit.write_text(json.dumps(manifest))

    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load .*state\.pt") as caught:
        ckpt.load_latest()
    assert "system" in str(caught.value)  # names what it refused
    assert not marker.exists()


def test_a_state_that_could_not_be_loaded_back_is_not_committed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(UnsafeCheckpointError, match="weights_only=True refuses"):
        checkpointer(tmp_path).save({"w": RunsCode(marker)}, step=1)
    assert not marker.exists()
    assert names(tmp_path / "checkpoints") == []
