"""examples/own_loop.py, the hand-written loop, under torchrun on 2 gloo ranks: a worker killed
with SIGKILL past a checkpoint and restarted by ``--max-restarts 1`` ends bitwise equal to a run
never stopped (model, optimizer, sampler position, each rank's PowerSGD state)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ups.core import AGENT_ENV
from ups.core.testing import assert_bitwise_equal

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY, DIE_AT = 12, 4, 10
"""The killed run saves at steps 4 and 8 in the background and dies at 10: it resumes from 8,
or from 4 when 8 was still being written (the save at 8 waited for 4's commit). 3 steps an
epoch (32 samples of 3 tasks, 16 a rank a step): the resumed epoch is not the one it died in."""


def start(out: Path, die_at: int = 0) -> subprocess.Popen[str]:
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        *("--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1"),
        *("--tee", "3", "--log-dir", str(out / "logs")),  # whole lines, each with its rank
        *(str(ROOT / "examples/own_loop.py"), "--out", str(out)),
        *("--steps", str(STEPS), "--every", str(EVERY), "--samples", "32"),
    ]
    env = {**os.environ, **AGENT_ENV, "OWN_LOOP_DIE_AT": str(die_at), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def final(out: Path) -> dict[str, object]:
    folder = out / "checkpoints" / f"step-{STEPS}"
    return {
        name: torch.load(folder / f"{name}.pt", weights_only=True)
        for name in ("state", "rank-0", "rank-1")
    }


@pytest.mark.slow
def test_killed_and_restarted_it_ends_bitwise_equal_to_a_run_never_stopped(
    tmp_path: Path,
) -> None:
    runs = {"whole": start(tmp_path / "whole"), "killed": start(tmp_path / "killed", DIE_AT)}
    output = {name: run.communicate(timeout=120)[0] for name, run in runs.items()}
    for name, run in runs.items():
        assert run.returncode == 0, f"the {name} run failed:\n{output[name]}"
    assert "resumed" not in output["whole"]
    resumed = dict(re.findall(r"resumed\s+rank=(\d+) step=(\d+)$", output["killed"], re.M))
    assert resumed.keys() == {"0", "1"}, output["killed"]
    assert set(resumed.values()) in ({"8"}, {"4"}), output["killed"]  # every rank the same
    whole, killed = final(tmp_path / "whole"), final(tmp_path / "killed")
    assert_bitwise_equal(killed, whole)
    state = whole["state"]
    assert isinstance(state, dict)
    # 2 ranks, 48 samples each, dealt in blocks of the loader's batch of 16
    assert (state["sampler"]["epoch"], state["sampler"]["segments"]) == (3, [[2, 48, 16]])
    assert sorted(p.name for p in (tmp_path / "killed/checkpoints").glob("step-*")) == [
        "step-12",
        "step-8",
    ]  # keep_last=2
