"""The ``local`` backend on two ranks: each rank writes its own file; a failure on one rank
raises on every rank and commits nothing. The commit protocol over a folder in one process
(loading, retention, unsafe pickles) is tested in ups-dist-core (``test_core_commit_faults.py``).

Multi-process tests run on real gloo process groups (``ups.core.testing.run_ranks``); their
rank functions are module-level so the spawned processes can import them.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import ups.ckpt
from ups.ckpt import (
    CheckpointError,
    LocalCheckpointer,
    LocalCheckpointOptions,
)
from ups.core import Loaded, RunContext
from ups.core.testing import run_ranks

SINGLE = RunContext()


def checkpointer(
    directory: Path, keep_last: int | None = 3, ctx: RunContext = SINGLE
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
    weights = torch.arange(6.0).reshape(2, 3) * (ctx.rank + 1)  # only rank 0's is kept
    first = ckpt.save(
        {"model": {"w": weights}, "step": 5},
        step=5,
        rank_state={"rng": torch.get_rng_state(), "rank": ctx.rank},
    )
    torch.rand(3)
    rng_at_save = torch.get_rng_state()
    location = ckpt.save(
        {"model": {"w": weights + 1}, "step": 10},
        step=10,
        rank_state={"rng": rng_at_save, "rank": ctx.rank},
    )
    expected_next = torch.rand(4)
    torch.manual_seed(999)  # scramble, then restore from the checkpoint
    loaded = checkpointer(Path(directory), ctx=ctx).load_latest()  # a new instance, as on resume
    assert loaded is not None and loaded.rank_state is not None
    torch.set_rng_state(loaded.rank_state["rng"])
    return {
        "empty": empty,
        "first": first,
        "location": location,
        "loaded": loaded,
        "next_matches": torch.equal(torch.rand(4), expected_next),
    }


@pytest.mark.slow
def test_two_ranks_save_and_load_round_trip(tmp_path: Path) -> None:
    results = run_ranks(_round_trip, 2, str(tmp_path))
    folder = tmp_path / "checkpoints"
    for rank, result in enumerate(results):
        assert result["empty"] is None
        assert result["first"] == str(folder / "step-5")
        assert result["location"] == str(folder / "step-10")  # the same path on every rank
        loaded = result["loaded"]
        assert isinstance(loaded, Loaded)
        assert loaded.step == 10 and loaded.location == str(folder / "step-10")
        assert torch.equal(loaded.state["model"]["w"], torch.arange(6.0).reshape(2, 3) + 1)
        assert loaded.state["step"] == 10
        assert loaded.rank_state is not None
        assert loaded.rank_state["rank"] == rank, f"rank {rank} got another rank's state"
        assert result["next_matches"], f"rank {rank}: its RNG state did not come back"
    assert names(folder) == ["latest", "step-10", "step-5"]
    assert (folder / "latest").read_text() == "step-10\n"
    commit = json.loads((folder / "step-10" / "COMMIT").read_text())
    assert commit["step"] == 10 and commit["world_size"] == 2
    assert set(commit["files"]) == {"state.pt", "rank-0.pt", "rank-1.pt"}
    for name, record in commit["files"].items():
        data = (folder / "step-10" / name).read_bytes()
        assert record == {"size": len(data), "crc32": zlib.crc32(data)}
    rank_states = [torch.load(folder / "step-10" / f"rank-{r}.pt") for r in (0, 1)]
    assert [s["rank"] for s in rank_states] == [0, 1]
    assert not torch.equal(rank_states[0]["rng"], rank_states[1]["rng"])

    # Loaded by a world of another size: the state, and no rank state.
    loaded = checkpointer(tmp_path).load_latest()
    assert loaded is not None
    assert loaded.step == 10 and loaded.rank_state is None
    assert torch.equal(loaded.state["model"]["w"], torch.arange(6.0).reshape(2, 3) + 1)


def _one_rank_fails(ctx: RunContext, directory: str) -> str:
    checkpointer(Path(directory), ctx=ctx).save({"step": 1}, step=1, rank_state={})
    failing = checkpointer(Path(directory), ctx=ctx)
    assert isinstance(failing, LocalCheckpointer)
    real_write = failing.storage.write_file

    def disk_full(path: Path, obj: Any) -> Any:
        if path.name == "rank-1.pt":
            raise OSError("disk full (simulated)")
        return real_write(path, obj)

    failing.storage.write_file = disk_full
    try:
        failing.save({"step": 2}, step=2, rank_state={})
    except CheckpointError as error:
        message = str(error)
    else:
        raise AssertionError(f"rank {ctx.rank}: the failed save did not raise")
    # Every rank is still in step with the others: the next collective works.
    loaded = checkpointer(Path(directory), ctx=ctx).load_latest()
    assert loaded is not None and loaded.step == 1
    return message


@pytest.mark.slow
def test_a_failure_on_one_rank_raises_on_every_rank_and_commits_nothing(tmp_path: Path) -> None:
    messages = run_ranks(_one_rank_fails, 2, str(tmp_path))
    for message in messages:
        assert "saving checkpoint step 2 failed on rank 1:" in message
        assert "OSError: disk full (simulated)" in message
    assert names(tmp_path / "checkpoints") == ["latest", "step-1"]  # no step-2, no .tmp left
