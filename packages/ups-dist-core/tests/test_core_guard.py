"""The training guard (``training.guard``) on real gloo ranks, with faults injected through
``UPS_FAULTS``: a step whose gradient norm is not finite or spikes is skipped by every rank,
or stops every rank with the same line, each bad step recorded in ``guard.jsonl`` and handed to
``ups_guard_record`` on rank 0; nothing detected, the run is bitwise the guard-off run, with no
collective added."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from ups.core import ConfigError, RunContext, load_config, load_plugins
from ups.core.config._config import GuardConfig
from ups.core.engine import Guard, GuardStoppedError, train_rank
from ups.core.engine._faults import ENV
from ups.core.testing import (
    assert_bitwise_equal,
    counting_all_reduces,
    install_plugin,
    read_checkpoint,
    run_ranks,
    run_ups,
    tiny_project,
)

OWN_STEP = '''"""A step of its own: (mean, count) losses."""
from ups.core import Step


class Mine(Step):
    def forward(self, module, batch):
        return module(batch[0])

    def loss(self, outputs, batch):
        return (outputs - batch[1]).pow(2).mean(), len(outputs)


def build():
    return Mine()
'''


def ended(ctx: RunContext, config_path: Path) -> dict[str, Any]:
    """Train on this rank: how the run ended (its steps, reports and final state), or the
    error it raised (its class and message), with the all-reduces the engine called."""
    with counting_all_reduces() as calls:
        try:
            result = train_rank(load_config(config_path), ctx, load_plugins())
        except Exception as error:
            return {"error": (type(error).__name__, str(error))}
    assert result.checkpoint is not None
    return {
        "steps": result.steps,
        "metrics": result.metrics,
        "state": read_checkpoint(result.checkpoint)["state"],
        "all_reduces": calls[0],
    }


def project(
    folder: Path,
    guard: dict[str, Any] | None,
    checkpoint: dict[str, Any] | None = None,
    **training: Any,
) -> Path:
    """The tiny project (64 samples, batches of 8 on 2 ranks: 4 steps an epoch) for 2 epochs,
    reporting every step, with ``training.guard: guard``."""
    return tiny_project(
        folder,
        run={"log_every": 1},
        checkpoint=checkpoint or {},
        training={"epochs": 2, "guard": guard, **training},
    )


def test_a_norm_that_is_not_finite_or_spikes_is_bad_and_fp16_leaves_overflows_to_its_scaler() -> (
    None
):
    guard = Guard(GuardConfig(spike=4.0, warmup_steps=2), RunContext(), scaled=False)
    assert guard.check(math.nan) == "the gradient norm is nan (not finite)"
    assert guard.check(math.inf) == "the gradient norm is inf (not finite)"
    assert guard.check(100.0) is None  # the first accepted steps: no spike yet
    assert guard.check(1.0) is None
    assert guard.accepted == 2 and guard.average == pytest.approx(0.98 * 100 + 0.02)
    assert guard.check(4 * guard.average) is None  # not over 4 times
    assert guard.check(500.0) == (
        "the gradient norm 500 is over training.guard.spike: 4 times its running average 103.9"
    )
    assert guard.accepted == 3  # a spike does not join the average
    scaled = Guard(GuardConfig(), RunContext(), scaled=True)
    assert scaled.check(math.inf) is None and scaled.overflows == 1 and scaled.accepted == 0


def test_a_bad_guard_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"training\.guard\.action.*'undo'"):
        load_config(project(tmp_path, {"action": "undo"}))
    with pytest.raises(ConfigError, match=r"training\.guard\.spike"):
        load_config(project(tmp_path, {"spike": 1}))


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_nan_on_one_rank_is_skipped_by_every_rank_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accumulation: int
) -> None:
    monkeypatch.setenv(ENV, "nan@1:2")
    config = project(tmp_path, {"action": "skip"}, accumulation_steps=accumulation)
    first, second = run_ranks(ended, 2, config)
    attempts = 8 // accumulation
    assert first["steps"] == second["steps"] == attempts - 1
    assert [m["guard_skipped"] for m in first["metrics"]] == [0] + [1] * (attempts - 2)
    assert all(math.isfinite(m["loss"]) for m in first["metrics"])
    assert_bitwise_equal(first["state"]["model"], second["state"]["model"])


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_skipped_last_step_leaves_the_run_as_it_was_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accumulation: int
) -> None:
    """The step is really not applied: a run whose last attempt is skipped ends bitwise as the
    run that stops before it (model, optimizer, scheduler)."""
    attempts = 8 // accumulation
    shorter = project(
        tmp_path / "shorter",
        None,
        accumulation_steps=accumulation,
        max_steps=attempts - 1,
        scheduler="StepLR",
        scheduler_options={"step_size": 1, "gamma": 0.9},
    )
    expected = run_ranks(ended, 2, shorter)[0]
    monkeypatch.setenv(ENV, f"nan@1:{attempts}")
    skipped = project(
        tmp_path / "skipped",
        {"action": "skip"},
        accumulation_steps=accumulation,
        scheduler="StepLR",
        scheduler_options={"step_size": 1, "gamma": 0.9},
    )
    found = run_ranks(ended, 2, skipped)[0]
    assert found["steps"] == expected["steps"] == attempts - 1  # the last attempt skipped
    for part in ("model", "optimizer", "scheduler"):
        assert_bitwise_equal(found["state"][part], expected["state"][part], part)


@pytest.mark.slow
def test_a_step_of_its_own_with_accumulation_is_guarded_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "nan@0:3")
    (tmp_path / "own_step.py").write_text(OWN_STEP)
    config = tiny_project(
        tmp_path,
        run={"log_every": 1},
        step={"factory": "own_step.py:build"},
        training={"epochs": 2, "accumulation_steps": 2, "guard": {"action": "skip"}},
    )
    first, _ = run_ranks(ended, 2, config)
    assert first["steps"] == 3 and first["metrics"][-1]["guard_skipped"] == 1


@pytest.mark.slow
def test_stop_stops_every_rank_with_one_line_naming_the_step_the_rank_and_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "nan@1:3")
    ends = run_ranks(ended, 2, project(tmp_path, {"action": "stop"}))
    said = (
        "step 3: the gradient norm is nan (not finite) (training.guard.action: stop); the loss "
        "was not finite on rank 1; epoch 1, batch 3 of each rank's share; samples: rank 0 ["
    )
    assert ends[0] == ends[1] and ends[0]["error"][0] == "GuardStoppedError"
    message = ends[0]["error"][1]
    assert message.startswith(said), message
    # each rank's 8 samples of the batch: 16 of the 64, none twice
    shown = re.findall(r"rank (\d) \[([\d, ]+)\]", message.split("samples: ")[1])
    assert [int(rank) for rank, _ in shown] == [0, 1]
    indices = [int(i) for _, listed in shown for i in listed.split(", ")]
    assert len(set(indices)) == 16 and all(0 <= i < 64 for i in indices), message


@pytest.mark.slow
def test_an_inf_gradient_with_finite_losses_stops_naming_no_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "inf@0:2")
    config = project(tmp_path, {"action": "stop"}, accumulation_steps=2)
    first, second = run_ranks(ended, 2, config)
    assert first == second
    kind, message = first["error"]
    assert kind == "GuardStoppedError"
    assert message.startswith("step 2: the gradient norm is ") and "(not finite)" in message
    assert "the loss was finite on every rank; epoch 1, batches 3-4 of each" in message


@pytest.mark.slow
@pytest.mark.parametrize("spike", [10.0, None])
def test_a_spike_is_skipped_when_spike_is_set_and_taken_when_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spike: float | None
) -> None:
    monkeypatch.setenv(ENV, "spike@1:5")
    config = project(tmp_path, {"action": "skip", "spike": spike, "warmup_steps": 2})
    first, _ = run_ranks(ended, 2, config)
    skipped = int(spike is not None)
    assert first["steps"] == 8 - skipped
    assert first["metrics"][-1]["guard_skipped"] == skipped


@pytest.mark.slow
@pytest.mark.parametrize(("max_skips", "faults", "step"), [(0, "2", 2), (1, "2,3", 2)])
def test_more_skips_than_the_budget_in_the_window_stop_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_skips: int, faults: str, step: int
) -> None:
    monkeypatch.setenv(ENV, f"nan@1:{faults}")
    config = project(tmp_path, {"action": "skip", "max_skips": max_skips, "window": 10})
    first, second = run_ranks(ended, 2, config)
    assert first == second
    kind, message = first["error"]
    assert kind == "GuardStoppedError"
    assert message.startswith(
        f"step {step}: the gradient norm is nan (not finite) ({max_skips + 1} bad steps in the "
        f"last 10, over training.guard.max_skips: {max_skips}); the loss was not finite on rank 1"
    )
    records = guard_records(tmp_path / "runs" / "tiny")
    assert [r["action"] for r in records] == ["skip"] * max_skips + ["stop"]
    assert records[-1]["reason"] in message


@pytest.mark.slow
@pytest.mark.parametrize("clip", [None, 1.0])
def test_the_guard_finding_nothing_changes_nothing_and_adds_no_collective(
    tmp_path: Path, clip: float | None
) -> None:
    """Bitwise the guard-off run, with as many all-reduces (none of its own; DDP's gradient
    all-reduce is the reducer's, not counted)."""
    guard = {"action": "stop", "spike": 100.0, "warmup_steps": 1}
    # No preemption signals: their agreement's all-reduces come as often as time says.
    unsignalled = {"preempt_signals": []}
    runs = {
        name: run_ranks(
            ended,
            2,
            project(tmp_path / name, on, checkpoint=unsignalled, grad_clip_norm=clip),
        )
        for name, on in (("off", None), ("on", guard))
    }
    for off, on in zip(runs["off"], runs["on"], strict=True):
        assert on["steps"] == off["steps"] == 8
        assert on["all_reduces"] == off["all_reduces"]
        assert_bitwise_equal(on["state"]["model"], off["state"]["model"])
        assert_bitwise_equal(on["state"]["optimizer"], off["state"]["optimizer"])
        assert all(m["guard_skipped"] == 0 and m["grad_norm"] > 0 for m in on["metrics"])


@pytest.mark.slow
def test_ups_train_prints_the_stop_as_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "nan@1:2")
    run = run_ups("train", str(project(tmp_path, {"action": "stop"})), "--nproc", "2")
    said = [line for line in run.stderr.splitlines() if line.startswith("ups: ")]
    assert len(said) == 1, run.stderr
    assert "step 2: the gradient norm is nan (not finite)" in said[0]
    assert "the loss was not finite on rank 1" in said[0]
    assert run.returncode == 2  # a StepError, as a loss that is not finite at a report


RECORDER = '''"""Appends each guard record it is handed, with its rank, to $GUARD_RECORDS."""
import json
import os

from ups.core import hookimpl


@hookimpl
def ups_guard_record(ctx, record):
    with open(os.environ["GUARD_RECORDS"], "a") as file:
        file.write(json.dumps({"rank": ctx.rank, "record": record}) + "\\n")
'''


def recorded(ctx: RunContext, config_path: Path, site: Path) -> dict[str, Any]:
    """:func:`ended`, with the plugins of ``site`` (:data:`RECORDER`'s) found too."""
    sys.path.insert(0, str(site))
    return ended(ctx, config_path)


def guard_records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "guard.jsonl").read_text().splitlines()]


def drawn(seed: int, rank: int, first: int, last: int) -> list[int]:
    """The sample indices of batches ``first`` to ``last`` (of 8) of ``rank``'s share of the
    first epoch of 64 samples on 2 ranks, as the ``torch`` sampler deals them."""
    sampler = DistributedSampler(range(64), num_replicas=2, rank=rank, seed=seed)
    sampler.set_epoch(0)
    return list(sampler)[(first - 1) * 8 : last * 8]


@pytest.mark.slow
@pytest.mark.parametrize(("action", "accumulation"), [("skip", 1), ("skip", 2), ("stop", 1)])
def test_every_bad_step_is_recorded_in_guard_jsonl_and_handed_to_the_hook_on_rank_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, action: str, accumulation: int
) -> None:
    """The NaN on rank 1 at attempt 2: its record names the step, its epoch and batches, the
    action, each rank's finiteness, sample indices (as the sampler dealt them) and their tasks
    (the two-task data: a sample's task is its index's parity); rank 0 alone hands it to
    ``ups_guard_record``, once, the same as the line written."""
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, "ups-recorder", "ups_recorder_plugin", RECORDER)
    monkeypatch.setenv("GUARD_RECORDS", str(tmp_path / "handed.jsonl"))
    monkeypatch.setenv(ENV, "nan@1:2")
    config = tiny_project(
        tmp_path,
        model={"factory": "torch.nn:Linear", "options": {"in_features": 4, "out_features": 1}},
        data={"factory": "ups.core.testing:two_task_dataset", "tasks": ["plus", "minus"]},
        training={"guard": {"action": action}, "accumulation_steps": accumulation},
    )
    ends = run_ranks(recorded, 2, config, site)
    assert ("error" in ends[0]) == (action == "stop")
    (record,) = guard_records(tmp_path / "runs" / "tiny")
    first, last = accumulation + 1, 2 * accumulation
    assert {k: v for k, v in record.items() if k != "ranks"} == {
        "step": 2,
        "epoch": 1,
        "batches": [first, last],
        "action": action,
        "reason": "the gradient norm is nan (not finite)"
        + (" (training.guard.action: stop)" if action == "stop" else ""),
    }
    seed = load_config(config).run.seed
    indices = [drawn(seed, rank, first, last) for rank in (0, 1)]
    assert record["ranks"] == [
        {
            "rank": rank,
            "finite": rank == 0,
            "tasks": [("plus", "minus")[task] for task in sorted({i % 2 for i in indices[rank]})],
            "indices": indices[rank],
        }
        for rank in (0, 1)
    ]
    handed = [json.loads(line) for line in (tmp_path / "handed.jsonl").read_text().splitlines()]
    assert handed == [{"rank": 0, "record": record}]


@pytest.mark.slow
def test_a_skip_killed_and_resumed_ends_bitwise_as_the_unkilled_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The NaN on rank 1 at attempt 3 is skipped; rank 0 killed at attempt 5, the restarted
    job resumes from the checkpoint of step 2 and passes over the skipped step, read from its
    own ``guard.jsonl``, with no LR cut (the skip made none): the run ends bitwise as the run
    never killed."""
    guard = {"action": "skip", "lr_factor": 0.5, "lr_steps": 3}
    scheduled = {"scheduler": "StepLR", "scheduler_options": {"step_size": 1, "gamma": 0.9}}
    monkeypatch.setenv(ENV, "nan@1:3")
    unkilled = run_ranks(ended, 2, project(tmp_path / "unkilled", guard, **scheduled))[0]
    assert unkilled["steps"] == 7
    config = project(tmp_path / "killed", guard, checkpoint={"every_steps": 2}, **scheduled)
    monkeypatch.setenv(ENV, "nan@1:3;kill@0:5")
    run = run_ups("train", str(config), "--nproc", "2", "--max-restarts", "1", timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "restarted by the launcher: resuming" in run.stderr, run.stderr[-3000:]
    run_dir = tmp_path / "killed" / "runs" / "tiny"
    assert [r["action"] for r in guard_records(run_dir)] == ["skip"]
    killed = read_checkpoint(run_dir / "checkpoints" / "step-7")["state"]
    for part in ("model", "optimizer", "scheduler"):
        assert_bitwise_equal(killed[part], unkilled["state"][part], part)


def own_loop_verdicts(ctx: RunContext, action: str) -> list[str]:
    """A hand-written DDP loop of 3 steps asking ``Guard.in_loop`` after each; rank 1's loss
    NaN at the second: the verdicts, or the error's message."""
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    guard = Guard.in_loop(ctx, action=action)
    verdicts = []
    for step in range(3):
        scale = float("nan") if (step, ctx.rank) == (1, 1) else 1.0
        loss = (model(torch.ones(2, 4)) * scale).square().mean()
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        try:
            verdicts.append(guard.verdict(loss, norm))
        except GuardStoppedError as stopped:
            return [str(stopped)]
        model.zero_grad()
    return verdicts


def test_a_guard_in_a_loop_of_ones_own_gives_every_rank_the_same_verdict() -> None:
    """One rank's NaN loss makes the averaged gradients NaN on both: both skip, or both roll
    back; with ``stop`` both raise one line naming rank 1."""
    assert run_ranks(own_loop_verdicts, 2, "skip") == [["step", "skip", "step"]] * 2
    assert run_ranks(own_loop_verdicts, 2, "rollback") == [["step", "rollback", "step"]] * 2
    stopped = run_ranks(own_loop_verdicts, 2, "stop")
    assert (
        stopped
        == [
            [
                "step 2: the gradient norm is nan (not finite) (training.guard.action: stop); the loss "
                "was not finite on rank 1"
            ]
        ]
        * 2
    )
    with pytest.raises(ConfigError, match=r"^options\.action: "):
        Guard.in_loop(RunContext(), action="retry")
