"""Resuming after a change to the model: one line naming the parameters that differ, the
checkpoint and what to do (exit 2 from ``ups train``), not torch's error per parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ups.core import ConfigError
from ups.core.checkpoint._model_state import SHOWN, differences, load_model_state
from ups.core.testing import run_ups, tiny_project

widths = st.integers(1, 6)


@settings(max_examples=50, deadline=None)
@given(saved=st.lists(widths, min_size=1, max_size=4), now=st.lists(widths, min_size=1, max_size=4))
def test_the_differences_are_every_name_missing_or_reshaped(
    saved: list[int], now: list[int]
) -> None:
    def model(widths: list[int]) -> nn.Module:
        return nn.Sequential(*(nn.Linear(2, w) for w in widths))

    there, here = model(saved).state_dict(), model(now).state_dict()
    found = differences(here, there)
    expected = sum(
        2
        for a, b in zip(saved, now, strict=False)
        if a != b  # a weight and a bias of another shape
    ) + 2 * abs(len(saved) - len(now))  # each layer one side lacks: its weight and bias
    assert len(found) == expected
    if not found:
        load_model_state(model(now), there, key="k", source="s", advice="a")  # loads
        return
    with pytest.raises(ConfigError) as raised:
        load_model_state(model(now), there, key="checkpoint.resume", source="x", advice="do y")
    message = str(raised.value)
    assert message.startswith("checkpoint.resume: the model does not match x: ")
    assert message.endswith("; do y") and "\n" not in message
    assert all(f in message for f in found[:SHOWN])
    assert ("more)" in message) == (len(found) > SHOWN)


@pytest.mark.slow
def test_resuming_a_changed_model_is_one_line_naming_parameters_and_checkpoint(
    tmp_path: Path,
) -> None:
    config = tiny_project(tmp_path, checkpoint={"every_steps": 4})
    assert run_ups("train", str(config), "--nproc", "2").returncode == 0
    changed = run_ups(
        "train", str(config), "--nproc", "2",
        "-o", "checkpoint.resume=latest", "-o", "model.options.width=16",
    )  # fmt: skip
    assert changed.returncode == 2, changed.stderr[-2000:]
    failed = [line for line in changed.stderr.splitlines() if line.startswith("ups: ")]
    checkpoint = Path("runs") / "tiny" / "checkpoints" / "step-4"
    assert len(failed) == 1, failed
    assert failed[0].startswith(
        "ups: rank 0 failed: ConfigError: checkpoint.resume: the model does not match the "
        f"checkpoint {tmp_path / checkpoint}: 0.weight: [8, 4] saved, [16, 4] in the model; "
        "0.bias: [8] saved, [16] in the model; 2.weight: [1, 8] saved, [1, 16] in the model; "
        "start afresh (checkpoint.resume: none) or in another run folder (run.name)"
    ), failed
    assert "Traceback" not in changed.stderr
    # the checkpoint is still there, for the old model to resume from
    assert (tmp_path / checkpoint / "COMMIT").is_file()
