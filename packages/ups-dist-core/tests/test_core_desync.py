"""Desync detection: the parameter checksum, the check over a real 2-rank group, and the
checks the training loop makes (at the start, and every ``distributed.desync_check_every``
steps) on 2 ranks training for real."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

from ups.core import RunContext, load_config, load_plugins
from ups.core.dist._desync import DesyncError, check_in_sync, parameter_checksum
from ups.core.engine import train_rank
from ups.core.testing import run_ranks, tiny_project

DRIFTING_MODEL = '''
import torch
import torch.distributed as dist
from torch import nn


def build_model(drift_at=0, drift_rank=1):
    """The tiny model; on rank ``drift_rank``, its ``drift_at``-th training forward pass first
    nudges the last bias (0: never), as a nondeterministic kernel or a plugin might."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    calls = [0]

    def pre_forward(module, args):
        calls[0] += module.training
        if calls[0] == drift_at and dist.get_rank() == drift_rank:
            with torch.no_grad():
                module[2].bias += 1e-6

    model.register_forward_pre_hook(pre_forward)
    return model
'''


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


def test_equal_parameters_give_equal_checksums_and_one_flipped_bit_another() -> None:
    a, b = model(), model()
    assert parameter_checksum(a) == parameter_checksum(b)
    with torch.no_grad():
        weight = b[0].weight.view(-1).view(torch.int32)
        weight[5] ^= 1  # the lowest bit of one float
    assert parameter_checksum(a) != parameter_checksum(b)


def test_buffers_are_left_out() -> None:
    a, b = model(), model()
    b[1].running_mean += 1  # DDP syncs buffers from rank 0 at the next forward
    assert parameter_checksum(a) == parameter_checksum(b)


def check(ctx: RunContext, diverge: str) -> str:
    """Rank 1 differs as ``diverge`` says (``none``, ``parameters``, ``config``); the check's
    message on this rank, or ``in sync``."""
    net = model()
    digest = "0123456789abcdef"
    if ctx.rank == 1 and diverge == "parameters":
        with torch.no_grad():
            net[2].bias += 1e-7
    if ctx.rank == 1 and diverge == "config":
        digest = "fedcba9876543210"
    try:
        check_in_sync(ctx, digest, 3, net)
    except DesyncError as error:
        return str(error)
    return "in sync"


def test_ranks_in_sync_pass_the_check() -> None:
    assert run_ranks(check, 2, "none") == ["in sync", "in sync"]


def test_a_diverged_rank_is_named_on_every_rank() -> None:
    expected = (
        "step 3: ranks out of sync with rank 0: rank 1 in its parameters (restart them from "
        "one checkpoint, with one config)"
    )
    assert run_ranks(check, 2, "parameters") == [expected, expected]
    assert run_ranks(check, 2, "config")[0].startswith(
        "step 3: ranks out of sync with rank 0: rank 1 in its config ("
    )


def trained(
    ctx: RunContext, config_path: Path, overrides: Mapping[int, Sequence[str]]
) -> tuple[str, str]:
    """Train on this rank, its config overridden by ``overrides[rank]``; return how it ended:
    ``("ok", steps)`` or ``(exception class, message)``."""
    config = load_config(config_path, overrides.get(ctx.rank, ()))
    try:
        result = train_rank(config, ctx, load_plugins(env={"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}))
    except Exception as error:
        return type(error).__name__, str(error)
    return "ok", str(result.steps)


def drifting_project(folder: Path, check_every: int | None) -> Path:
    """The tiny project for 2 epochs (8 steps on 2 ranks), reporting every 2 steps; rank 1's
    parameters drift in step 3's forward pass."""
    config = tiny_project(
        folder,
        model={"factory": "drift.py:build_model", "options": {"drift_at": 3}},
        training={"epochs": 2},
        distributed={"desync_check_every": check_every},
    )
    (folder / "drift.py").write_text(DRIFTING_MODEL)
    return config


def reported_steps(folder: Path) -> list[int]:
    """The steps of the training reports rank 0 wrote (none without a metrics file)."""
    path = folder / "runs" / "tiny" / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.mark.slow
def test_the_periodic_check_stops_every_rank_at_the_first_check_after_a_drift(
    tmp_path: Path,
) -> None:
    outcomes = run_ranks(trained, 2, drifting_project(tmp_path, 2), {})
    # The check after step 2 passes; rank 1 drifts in step 3; the check after step 4 finds it.
    expected = (
        "DesyncError",
        "step 4: ranks out of sync with rank 0: rank 1 in its parameters (restart them from "
        "one checkpoint, with one config)",
    )
    assert outcomes == [expected, expected]
    # Step 2's report was written at step 3; step 4's would have been at step 5: never run.
    assert reported_steps(tmp_path) == [2]


@pytest.mark.slow
def test_without_the_periodic_check_a_drift_goes_unnoticed(tmp_path: Path) -> None:
    """``desync_check_every: null`` checks at the start only: the drifted run trains on."""
    outcomes = run_ranks(trained, 2, drifting_project(tmp_path, None), {})
    assert outcomes == [("ok", "8"), ("ok", "8")]
    assert reported_steps(tmp_path) == [2, 4, 6, 8]


@pytest.mark.slow
def test_a_rank_with_another_config_stops_every_rank_before_the_first_step(
    tmp_path: Path,
) -> None:
    config = tiny_project(tmp_path, training={"epochs": 2})
    outcomes = run_ranks(trained, 2, config, {1: ["training.lr=0.1"]})
    expected = (
        "DesyncError",
        "step 0: ranks out of sync with rank 0: rank 1 in its config (restart them from one "
        "checkpoint, with one config)",
    )
    assert outcomes == [expected, expected]
    assert reported_steps(tmp_path) == []
