"""The EMA of the weights (``training.ema``, :class:`ups.core.EMA`): equal to a plain-Python
reference, the same on 2 gloo ranks without communication, evaluated beside the live weights,
saved in checkpoints, resumed bitwise, and its bad input refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ups.core import EMA, RunContext, train
from ups.core.testing import (
    assert_bitwise_equal,
    counting_all_reduces,
    read_checkpoint,
    run_ranks,
    run_ups,
    tiny_project,
)

EVAL = {"factory": "tiny.py:build_dataset", "options": {"n": 24}, "every_steps": 4}


def reference(values: list[float], decay: float, every: int, start: int, warmup: bool) -> float:
    """The EMA of ``values[0]`` (the initial weight) and the weights after steps 1, 2, ...,
    written out in plain Python."""
    average = values[0]
    for step, value in enumerate(values[1:], start=1):
        if step <= start:
            average = value
        elif (step - start) % every == 0:
            d = decay
            if warmup:
                n = (step - start) // every
                d = min(decay, (1 + n) / (10 + n))
            average = d * average + (1 - d) * value
    return average


@settings(max_examples=60, deadline=None)
@given(
    decay=st.floats(0.01, 0.999),
    every=st.integers(1, 4),
    start=st.integers(0, 6),
    warmup=st.booleans(),
    values=st.lists(st.floats(-10, 10), min_size=1, max_size=25),
)
def test_the_average_is_a_plain_python_ema(
    decay: float, every: int, start: int, warmup: bool, values: list[float]
) -> None:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(values[0])
    ema = EMA(model, decay, every_steps=every, start_step=start, warmup=warmup)
    for step, value in enumerate(values[1:], start=1):
        with torch.no_grad():
            model.weight.fill_(value)
        ema.update(step)
    found = ema.averaged()["weight"].item()
    assert found == pytest.approx(reference(values, decay, every, start, warmup), abs=1e-4)


def test_buffers_are_averaged_or_copied_and_the_model_gets_its_weights_back() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).bfloat16()
    ema = EMA(model, 0.5)
    assert {t.dtype for t in ema.averaged().values()} == {torch.float32, torch.int64}
    model(torch.randn(8, 3, dtype=torch.bfloat16))  # updates the running statistics
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ema.update(1)
    averaged = ema.averaged()
    assert averaged["1.num_batches_tracked"] == 1  # copied
    expected = (before["1.running_var"].float() + 1) / 2  # averaged with its initial ones
    torch.testing.assert_close(averaged["1.running_var"], expected)
    with ema.applied():
        assert torch.equal(model[0].weight, averaged["0.weight"].bfloat16())
    assert_bitwise_equal(dict(model.state_dict()), before)
    copy = EMA(model, 0.9)
    copy.load_state_dict(ema.state_dict())
    assert_bitwise_equal(copy.averaged(), averaged)
    with pytest.raises(ValueError, match=r"another model's: missing \['weight'\]"):
        EMA(nn.Linear(1, 1, bias=False)).load_state_dict(ema.state_dict())


def test_complex_parameters_are_averaged() -> None:
    model = nn.Module()
    model.weight = nn.Parameter(torch.zeros(2, dtype=torch.cfloat))
    ema = EMA(model, 0.75)
    with torch.no_grad():
        model.weight.fill_(4 + 8j)
    ema.update(1)
    assert ema.averaged()["weight"].tolist() == [1 + 2j, 1 + 2j]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"decay": 1.0}, r"^decay must be in \(0, 1\), e.g. 0.999; got 1.0$"),
        ({"decay": 0.9, "every_steps": 0}, r"^every_steps must be >= 1; got 0$"),
        ({"decay": 0.9, "start_step": -1}, r"^start_step must be >= 0; got -1$"),
    ],
)
def test_bad_arguments_are_refused_naming_them(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EMA(nn.Linear(1, 1), **arguments)


def _ddp_with_ema(ctx: RunContext) -> dict[str, Any]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ema = EMA(model, 0.9, warmup=True)
    generator = torch.Generator().manual_seed(ctx.rank)  # each rank its own batches
    updates = 0
    for step in range(1, 6):
        x = torch.randn(8, 4, generator=generator)
        ddp(x).sub(x.sum(1, keepdim=True)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        with counting_all_reduces() as counted:
            ema.update(step)
        updates += counted[0]
    return {"ema": ema.averaged(), "model": model.state_dict(), "all_reduces": updates}


@pytest.mark.slow
def test_on_two_gloo_ranks_every_rank_holds_the_same_ema_without_communicating() -> None:
    first, second = run_ranks(_ddp_with_ema, 2)
    assert_bitwise_equal(first["ema"], second["ema"])
    assert first["all_reduces"] == second["all_reduces"] == 0
    assert not torch.equal(first["ema"]["0.weight"], first["model"]["0.weight"])


def project(folder: Path, max_steps: int, resume: str, **ema: Any) -> Path:
    """The tiny project, 64 samples in batches of 4 on 2 ranks (8 steps an epoch), 3 epochs,
    an EMA and an evaluation every 4 steps, checkpoints every 3."""
    return tiny_project(
        folder,
        eval=EVAL,
        training={
            "epochs": 3,
            "batch_size": 4,
            "max_steps": max_steps,
            "ema": {"decay": 0.8, **ema},
        },
        checkpoint={"every_steps": 3, "resume": resume, "options": {"keep_last": 5}},
    )


@pytest.mark.slow
def test_a_run_with_ema_evaluates_both_and_saves_it_and_resumes_bitwise(tmp_path: Path) -> None:
    whole = train(project(tmp_path / "whole", 14, "none", warmup=True), nproc=2)
    assert train(project(tmp_path / "parts", 5, "latest", warmup=True), nproc=2).steps == 5
    rest = train(project(tmp_path / "parts", 14, "latest", warmup=True), nproc=2)
    assert rest.steps == whole.steps == 14
    assert whole.checkpoint is not None and rest.checkpoint is not None
    a, b = (read_checkpoint(r.checkpoint)["state"] for r in (whole, rest))
    assert_bitwise_equal(b["ema"], a["ema"])
    assert_bitwise_equal(b["model"], a["model"])
    assert a["ema"]["model"].keys() == a["model"].keys()
    assert not torch.equal(a["ema"]["model"]["0.weight"], a["model"]["0.weight"])
    assert set(whole.eval_metrics[-1]) == {"loss", "samples", "loss_ema"}
    assert rest.eval_metrics[-1] == whole.eval_metrics[-1]
    report = run_ups("report", str(tmp_path / "whole" / "runs" / "tiny"))
    assert report.returncode == 0, report.stderr
    assert "eval loss_ema" in report.stdout


@pytest.mark.slow
def test_evaluating_the_ema_instead_reports_it_under_the_plain_names(tmp_path: Path) -> None:
    both = train(project(tmp_path / "both", 8, "none"), nproc=1)
    instead = train(project(tmp_path / "instead", 8, "none", evaluate="ema"), nproc=1)
    live = train(project(tmp_path / "live", 8, "none", evaluate="live"), nproc=1)
    assert instead.eval_metrics[-1]["loss"] == both.eval_metrics[-1]["loss_ema"]
    assert live.eval_metrics[-1] == {k: v for k, v in both.eval_metrics[-1].items() if "_" not in k}


@pytest.mark.parametrize("decay", ["1.5", "0.0", "1.0"])
def test_a_decay_outside_the_open_unit_interval_is_one_line_before_any_rank(
    tmp_path: Path, decay: str
) -> None:
    config = tiny_project(tmp_path)
    done = run_ups("train", str(config), "--nproc", "2", "-o", f"training.ema.decay={decay}")
    assert done.returncode == 2
    assert done.stderr == (
        f"ups: error: {config}: training.ema.decay: {decay} is not allowed: "
        "must be in (0, 1), e.g. 0.999\n"
    )
    assert not (tmp_path / "runs").exists()
