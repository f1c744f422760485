"""A third-party plugin keeps its own state in checkpoints (``ups_checkpoint_state``) and gets
it back, each rank its own, when the run resumes (``ups_checkpoint_restore``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ups.core.testing import install_plugin, run_ups, tiny_project

PLUGIN = '''
"""Counts the reports each rank saw; keeps the count in checkpoints."""
import json
import pathlib

from ups.core import hookimpl

seen = {"reports": 0}


@hookimpl
def ups_step_end(ctx, step, metrics):
    seen["reports"] += 1


@hookimpl
def ups_checkpoint_state(ctx):
    return {"counter": {"reports": seen["reports"], "rank": ctx.rank}}


@hookimpl
def ups_checkpoint_restore(ctx, state):
    seen.update(reports=state["counter"]["reports"])
    out = pathlib.Path(f"restored-{ctx.rank}.json")
    out.write_text(json.dumps(state["counter"]))
'''


@pytest.mark.slow
def test_a_plugins_state_is_saved_per_rank_and_restored_on_resume(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, "ups-counter", "ups_counter", PLUGIN)

    def run(max_steps: int) -> None:
        config = tiny_project(
            tmp_path,
            training={"epochs": 4, "max_steps": max_steps},
            checkpoint={"name": "local", "resume": "latest"},
        )
        train = ("train", str(config), "--nproc", "2")
        result = run_ups(*train, cwd=tmp_path, env={"PYTHONPATH": str(site)}, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]

    run(6)  # reports at steps 2, 4, 6: 3 on each rank
    assert not list(tmp_path.glob("restored-*.json"))
    run(10)
    restored = [json.loads((tmp_path / f"restored-{r}.json").read_text()) for r in (0, 1)]
    assert restored == [{"reports": 3, "rank": 0}, {"reports": 3, "rank": 1}]
