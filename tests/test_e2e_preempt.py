"""Preemption: a signal makes every rank save at the same step boundary and stop cleanly; the
run resumed from there ends bitwise equal to one never stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_e2e_resume import final_state, project

from ups.core import train
from ups.core.testing import assert_bitwise_equal, wait_for

SIGNALLING_MODEL = """
import os
import signal
import time

import torch
from torch import nn


def build_model(signal_at=0, signal_name="SIGUSR1", signal_rank=1):
    '''The dropout model; rank ``signal_rank`` sends itself ``signal_name`` in its
    ``signal_at``-th training forward pass (0: never).'''
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 1))
    calls = [0]

    def pre_forward(module, args):
        calls[0] += module.training
        if calls[0] == signal_at and int(os.environ.get("RANK", 0)) == signal_rank:
            os.kill(os.getpid(), getattr(signal, signal_name))

    model.register_forward_pre_hook(pre_forward)
    if signal_at:  # steps of 50 ms, so that the run is still going when the ranks agree
        model.register_forward_hook(lambda *_: time.sleep(0.05))
    return model
"""


def signalling_project(folder: Path, max_steps: int, resume: str, **options: object) -> Path:
    return project(
        folder, max_steps, resume, backend="local", model=SIGNALLING_MODEL, model_options=options
    )


@pytest.mark.slow
@pytest.mark.parametrize("signal_name", ["SIGUSR1", "SIGTERM"])
def test_a_signal_to_one_rank_stops_every_rank_at_one_step_saved(
    tmp_path: Path, signal_name: str
) -> None:
    whole = train(signalling_project(tmp_path / "whole", 14, "none"), nproc=2)
    parts = signalling_project(
        tmp_path / "parts", 14, "latest", signal_at=5, signal_name=signal_name
    )
    stopped = train(parts, nproc=2)
    # Rank 1 is signalled in step 5; every rank learns it at the same later step (two checks,
    # 0.1 s apart, of steps of 0.05 s: step 6 to 10), saves and stops.
    assert stopped.preempted
    assert 6 <= stopped.steps <= 10
    assert stopped.checkpoint is not None and stopped.checkpoint.endswith(f"step-{stopped.steps}")
    rest = train(signalling_project(tmp_path / "parts", 14, "latest"), nproc=2)
    assert not rest.preempted
    assert (rest.steps, rest.epochs) == (whole.steps, whole.epochs)
    a, b = final_state(whole), final_state(rest)
    for key in ("model", "optimizer", "step", "rng", "ranks"):
        assert_bitwise_equal(a[key], b[key])


@pytest.mark.slow
@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGUSR1"])
def test_ups_train_signalled_saves_and_exits_without_a_traceback(
    tmp_path: Path, signal_name: str
) -> None:
    """torch's agent passes SIGTERM on to the ranks; ups passes SIGUSR1 on too."""
    config = signalling_project(tmp_path, 1_000_000, "none")
    log = tmp_path / "runs" / "tiny" / "logs" / "rank0.jsonl"
    env = {**os.environ, "UPS_LOG_FORMAT": "json"}
    process = subprocess.Popen(
        # Epochs enough that the run is still going when the signal comes, however slow the
        # machine is to notice its first step (3 epochs ended before it, once, in CI).
        [
            *(sys.executable, "-m", "ups.core", "train", str(config), "--nproc", "2"),
            *("-o", "training.epochs=100000"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )

    def stopped() -> str:
        process.kill()
        return process.communicate()[1][-3000:]

    wait_for(
        lambda: log.is_file() and '"event": "step"' in log.read_text(),
        60,
        "a training report",
        process=process,
        details=stopped,
    )
    process.send_signal(getattr(signal, signal_name))
    _, err = process.communicate(timeout=60)
    assert process.returncode == 75, err  # preempted, resumable
    assert "Traceback" not in err
    saved = re.search(rf"ups: preempted by {signal_name}: the ranks saved at step (\d+);", err)
    assert saved is not None, err
    # The save at the preemption is committed, is the newest, and is what a resume loads.
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    committed = [int(p.name[5:]) for p in checkpoints.glob("step-*") if (p / "COMMIT").is_file()]
    assert max(committed, default=None) == int(saved[1]), (committed, err)
    assert (checkpoints / "latest").read_text().strip() == f"step-{saved[1]}"
    for rank in (0, 1):
        text = (tmp_path / "runs" / "tiny" / "logs" / f"rank{rank}.jsonl").read_text()
        assert "preempted: saving and stopping" in text
