"""decide and all_mean on real 2-rank gloo groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ups.core import CheckpointError, ConfigError, RunContext, UsageError, all_mean, decide
from ups.core.checkpoint._simple import SimpleCheckpointer, SimpleCheckpointOptions
from ups.core.testing import run_ranks


def decide_by_rank(ctx: RunContext) -> dict[str, int]:
    # Only rank 0's function runs: each rank would answer differently.
    return decide(ctx, lambda: {"lr_multiplier": 10 + ctx.rank})


def test_decide_returns_rank_0s_decision_everywhere() -> None:
    assert run_ranks(decide_by_rank, 2) == [{"lr_multiplier": 10}, {"lr_multiplier": 10}]


def fail_on_rank_0(ctx: RunContext, error: Exception) -> tuple[str, bool, str]:
    def decision() -> str:
        raise error

    try:
        decide(ctx, decision)
    except Exception as raised:
        return type(raised).__name__, isinstance(raised, UsageError), str(raised)
    return "no error", False, ""


@pytest.mark.parametrize(
    ("error", "usage"), [(OSError("disk full"), False), (ConfigError("lr", "not a number"), True)]
)
def test_a_failed_decision_raises_its_error_on_rank_0_and_names_it_on_the_others(
    error: Exception, usage: bool
) -> None:
    said = f"{type(error).__name__}: {error}"
    assert run_ranks(fail_on_rank_0, 2, error) == [
        (type(error).__name__, usage, str(error)),
        # bad input is a usage error on every rank: the command line exits 2 on each
        ("RankUsageError" if usage else "RankFailedError", usage, f"rank 0 failed: {said}"),
    ]


def mean_of_ranks(ctx: RunContext) -> list[float]:
    return all_mean(ctx, torch.tensor([float(ctx.rank), 10.0])).tolist()


def test_all_mean() -> None:
    assert run_ranks(mean_of_ranks, 2) == [[0.5, 10.0], [0.5, 10.0]]


def save_and_load(ctx: RunContext, folder: str) -> tuple[str, int, list[float], object]:
    ckpt = SimpleCheckpointer(
        ctx=ctx, directory=Path(folder), options=SimpleCheckpointOptions(keep_last=2)
    )
    for step in (1, 2, 3):
        state = {"w": torch.full((2,), float(step)), "rank": ctx.rank}
        location = ckpt.save(state, step=step, rank_state={"mine": ctx.rank * 10 + step})
    ckpt.wait()
    loaded = ckpt.load_latest()
    assert loaded is not None
    assert loaded.state["rank"] == 0  # rank 0's state is the one kept
    assert loaded.location == location
    return location, loaded.step, loaded.state["w"].tolist(), loaded.rank_state


def load_rank_state(ctx: RunContext, folder: str) -> object:
    ckpt = SimpleCheckpointer(ctx=ctx, directory=Path(folder), options=SimpleCheckpointOptions())
    loaded = ckpt.load_latest()
    assert loaded is not None
    return loaded.rank_state


def test_simple_checkpoint_round_trip_and_retention(tmp_path: Path) -> None:
    results = run_ranks(save_and_load, 2, str(tmp_path))
    expected = str(tmp_path / "checkpoints" / "step-3")
    assert results == [
        (expected, 3, [3.0, 3.0], {"mine": 3}),
        (expected, 3, [3.0, 3.0], {"mine": 13}),
    ]
    # Another number of ranks has no state of its own in the checkpoint.
    assert run_ranks(load_rank_state, 1, str(tmp_path)) == [None]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step-2",
        "step-3",
    ]


def test_simple_checkpoint_refuses_the_one_file_layout_of_earlier_versions(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"state": {}, "ranks": [{}]}, folder / "step-000000001.pt")
    ckpt = SimpleCheckpointer(
        ctx=RunContext(), directory=tmp_path, options=SimpleCheckpointOptions()
    )
    with pytest.raises(
        CheckpointError, match=r"step-000000001\.pt is a checkpoint in the one-file layout"
    ):
        ckpt.load_latest()


def test_simple_checkpoint_skips_a_damaged_file_for_the_newest_that_reads(tmp_path: Path) -> None:
    ckpt = SimpleCheckpointer(
        ctx=RunContext(), directory=tmp_path, options=SimpleCheckpointOptions(keep_last=3)
    )
    for step in (1, 2, 3):
        ckpt.save({"w": torch.full((2,), float(step))}, step=step, rank_state={})
    newest = tmp_path / "checkpoints" / "step-3" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # cut short, as by a failing disk
    (tmp_path / "checkpoints" / "step-2" / "state.pt").write_bytes(b"")  # emptied
    loaded = ckpt.load_latest()
    assert loaded is not None
    assert (loaded.step, loaded.state["w"].tolist()) == (1, [1.0, 1.0])


def test_no_checkpoint_gives_none(tmp_path: Path) -> None:
    ckpt = SimpleCheckpointer(
        ctx=RunContext(), directory=tmp_path, options=SimpleCheckpointOptions()
    )
    assert ckpt.load_latest() is None
