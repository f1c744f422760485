"""The one commit protocol (``ups.core.checkpoint._commit``), as every storage keeps it: the built-in
``simple`` folder, ``local``, and ``fsspec`` (on a local path, no server)."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
import torch

from ups.ckpt import checkpointer
from ups.core import Committing, RunContext, SimpleCheckpointer, SimpleCheckpointOptions

KEEP_LAST = 3


def storage(name: str, folder: Path) -> Committing[object]:
    ctx = RunContext()
    if name == "simple":
        options = SimpleCheckpointOptions(keep_last=KEEP_LAST)
        built: object = SimpleCheckpointer(ctx=ctx, directory=folder, options=options)
    elif name == "local":
        built = checkpointer(folder, ctx=ctx, keep_last=KEEP_LAST)
    else:
        built = checkpointer(f"file://{folder}/store", ctx=ctx, keep_last=KEEP_LAST)
    assert isinstance(built, Committing)  # the protocol, not a copy of it
    return built


def path(location: str) -> Path:
    """The local path of a checkpoint's location (a path, or a ``file://`` URL)."""
    return Path(location.removeprefix("file://"))


@pytest.mark.parametrize("name", ["simple", "local", "fsspec"])
def test_every_storage_commits_retains_and_loads_alike(tmp_path: Path, name: str) -> None:
    ckpt = storage(name, tmp_path)
    for step in (1, 2, 3, 4, 5):
        where = ckpt.save({"w": torch.full((2,), float(step))}, step=step, rank_state={"r": step})
        assert where == ckpt.location(step)
    assert [c.step for c in ckpt.committed()] == [3, 4, 5]  # keep_last

    # A torn save: step 5 published, its COMMIT never written. Never loaded.
    (path(ckpt.location(5)) / "COMMIT").unlink()
    # Step 4 damaged since it committed: skipped, with a warning naming it.
    state = path(ckpt.location(4)) / "state.pt"
    state.write_bytes(state.read_bytes()[:-8])
    with structlog.testing.capture_logs() as logs:
        loaded = storage(name, tmp_path).load_latest()  # a new instance, as on resume

    assert loaded is not None  # the newest committed checkpoint that verifies wins
    assert (loaded.step, loaded.location) == (3, ckpt.location(3))
    assert loaded.state["w"].tolist() == [3.0, 3.0] and loaded.rank_state == {"r": 3}
    skipped = [e["checkpoint"] for e in logs if e["event"].startswith("damaged checkpoint")]
    assert skipped == [ckpt.location(4)]
