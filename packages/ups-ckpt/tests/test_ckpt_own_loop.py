"""``ups.ckpt.checkpointer`` in a loop of one's own: built from a folder and options, on real
gloo ranks, it saves a user's state dict in the background, keeps the newest N and loads the
newest committed one; bad arguments are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ups.ckpt import checkpointer
from ups.core import ConfigError, RunContext
from ups.core.testing import assert_bitwise_equal, run_ranks


def _train_and_save(ctx: RunContext, folder: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    checkpoints = checkpointer(folder, ctx=ctx, keep_last=2, async_save=True)
    assert checkpoints.load_latest() is None
    for step in range(1, 4):
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        checkpoints.save(state, step=step, rank_state={"rank": torch.tensor([ctx.rank])})
    checkpoints.wait()
    loaded = checkpoints.load_latest()
    assert loaded is not None and loaded.rank_state is not None
    return {"step": loaded.step, "saved": state, "loaded": loaded.state, **loaded.rank_state}


@pytest.mark.slow
def test_every_rank_saves_in_the_background_and_loads_the_newest_kept(tmp_path: Path) -> None:
    results = run_ranks(_train_and_save, 2, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["step"] == 3
        assert_bitwise_equal(result["loaded"], result["saved"])
        assert result["rank"].tolist() == [rank]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == [
        "step-2",
        "step-3",
    ]


def test_bad_arguments_are_refused_naming_them(tmp_path: Path) -> None:
    ctx = RunContext()
    file = tmp_path / "a-file"
    file.write_text("")
    with pytest.raises(ConfigError, match=r"^location: .*a-file is a file; give a folder"):
        checkpointer(file, ctx=ctx)
    with pytest.raises(ConfigError, match=r"^keep_last: 'three' is not an integer or null$"):
        checkpointer(tmp_path, ctx=ctx, keep_last="three")
    with pytest.raises(ConfigError, match=r"^keep_lats: unknown key.*did you mean 'keep_last'"):
        checkpointer(tmp_path, ctx=ctx, keep_lats=2)
    with pytest.raises(ConfigError, match=r"^sharded: is for a folder"):
        checkpointer("s3://bucket/run", ctx=ctx, sharded=True)


def test_the_folder_is_made_when_the_checkpointer_is_and_one_that_cannot_be_is_named(
    tmp_path: Path,
) -> None:
    ctx = RunContext()
    folder = tmp_path / "runs" / "new"
    checkpoints = checkpointer(folder, ctx=ctx)
    assert folder.is_dir()  # before any save: a loop may write beside its checkpoints
    assert checkpoints.load_latest() is None
    under_a_file = tmp_path / "a-file" / "run"
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"^location: cannot make the folder .*a-file/run: "):
        checkpointer(under_a_file, ctx=ctx)
