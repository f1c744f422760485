"""docs/checkpoints.md's example storage of another layout (``flat``: flat files of one folder),
taken from the page as written: the commit protocol's contract through it, on one process and
on two real ranks, saving, and resuming a run."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any

import structlog
import torch

from ups.core import Committing, RunContext, load_config, load_plugins
from ups.core.engine import train_rank
from ups.core.testing import run_ranks, tiny_project

CHECKPOINTS_MD = Path(__file__).resolve().parents[3] / "docs" / "checkpoints.md"
NO_AUTOLOAD = {"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}


def example() -> types.ModuleType:
    """The block checkpoints.md saves as ``flat_storage.py``, as a plugin module."""
    text = CHECKPOINTS_MD.read_text()
    [code] = re.findall(
        r"^<!-- save: flat_storage\.py -->\n```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL
    )
    module = types.ModuleType("flat_storage")
    exec(compile(code, f"{CHECKPOINTS_MD}:flat_storage.py", "exec"), module.__dict__)
    return module


def flat(ctx: RunContext, directory: Path, keep_last: int | None = 3) -> Committing:
    flat_storage = example()
    options = flat_storage.FlatOptions(keep_last=keep_last)
    built: Committing = flat_storage.flat_checkpointer(
        ctx=ctx, directory=directory, options=options
    )
    return built


def test_the_flat_storage_commits_retains_and_loads_as_every_storage_does(tmp_path: Path) -> None:
    ckpt = flat(RunContext(), tmp_path)
    for step in (1, 2, 3, 4, 5):
        where = ckpt.save({"w": torch.full((2,), float(step))}, step=step, rank_state={"r": step})
        assert where == ckpt.location(step) == str(tmp_path / "flat" / f"ckpt-{step}")
    assert [c.step for c in ckpt.committed()] == [3, 4, 5]  # keep_last
    assert not list((tmp_path / "flat").glob(".staged-*"))

    # A torn save: step 5 published, its COMMIT never written. Never loaded.
    Path(ckpt.storage.location("step-5", "COMMIT")).unlink()
    # Step 4 damaged since it committed: skipped, with a warning naming it.
    state = Path(ckpt.storage.location("step-4", "state.pt"))
    state.write_bytes(state.read_bytes()[:-8])
    with structlog.testing.capture_logs() as logs:
        again = flat(RunContext(), tmp_path)  # a new instance, as on resume
        loaded = again.load_latest()

    assert loaded is not None  # the newest committed checkpoint that verifies wins
    assert (loaded.step, loaded.location) == (3, ckpt.location(3))
    assert loaded.state["w"].tolist() == [3.0, 3.0] and loaded.rank_state == {"r": 3}
    skipped = [e["checkpoint"] for e in logs if e["event"].startswith("damaged checkpoint")]
    assert skipped == [ckpt.location(4)]
    # The next save sweeps the torn step 5 (uncommitted), and saves step 4 again over it.
    again.save({"w": torch.zeros(2)}, step=4, rank_state={})
    assert [c.step for c in again.committed()] == [3, 4]
    assert sorted(p.name for p in (tmp_path / "flat").glob("ckpt-4.*")) == [
        "ckpt-4.COMMIT",
        "ckpt-4.rank-0.pt",
        "ckpt-4.state.pt",
    ]


def _save(ctx: RunContext, folder: str) -> list[str]:
    ckpt = flat(ctx, Path(folder), keep_last=2)
    for step in (1, 2, 3):
        state = {"w": torch.full((3,), float(step))}
        ckpt.save(state, step=step, rank_state={"rank": ctx.rank, "step": step})
    return sorted(p.name for p in (Path(folder) / "flat").iterdir())


def _load(ctx: RunContext, folder: str) -> tuple[int, list[float], Any, str]:
    loaded = flat(ctx, Path(folder)).load_latest()
    assert loaded is not None
    return loaded.step, loaded.state["w"].tolist(), loaded.rank_state, loaded.location


def test_two_ranks_save_and_resume_through_the_flat_storage(tmp_path: Path) -> None:
    files = [
        f"ckpt-{step}.{name}"
        for step in (2, 3)
        for name in ("COMMIT", "rank-0.pt", "rank-1.pt", "state.pt")
    ]
    assert run_ranks(_save, 2, str(tmp_path)) == [[*files, "latest.pointer"]] * 2
    location = str(tmp_path / "flat" / "ckpt-3")
    assert run_ranks(_load, 2, str(tmp_path)) == [
        (3, [3.0] * 3, {"rank": rank, "step": 3}, location) for rank in (0, 1)
    ]
    # On another number of ranks, the replicated state only.
    assert _load(RunContext(), str(tmp_path)) == (3, [3.0] * 3, None, location)


def _train(ctx: RunContext, config: Path) -> tuple[int, tuple[float, ...], str | None]:
    registry = load_plugins(extra=[("flat", example())], env=NO_AUTOLOAD)
    result = train_rank(load_config(config), ctx, registry)
    return result.steps, result.losses, result.checkpoint


def test_a_run_stopped_and_resumed_through_the_flat_backend_goes_on_as_one_never_stopped(
    tmp_path: Path,
) -> None:
    checkpoint = {"name": "flat", "every_steps": 2}
    whole = tiny_project(tmp_path / "whole", training={"epochs": 2}, checkpoint=checkpoint)
    [(steps, losses, _), _] = run_ranks(_train, 2, whole)

    half = tiny_project(tmp_path / "half", checkpoint=checkpoint)
    [(stopped_at, first, _), _] = run_ranks(_train, 2, half)
    resumed = tiny_project(
        tmp_path / "half", training={"epochs": 2}, checkpoint={**checkpoint, "resume": "latest"}
    )
    [(ended_at, rest, where), _] = run_ranks(_train, 2, resumed)

    assert 0 < stopped_at < ended_at == steps and first and rest
    assert where == str(tmp_path / "half" / "runs" / "tiny" / "flat" / f"ckpt-{steps}")
    assert (*first, *rest) == losses  # bitwise, on CPU
