"""Keep-best (``checkpoint.options.keep_best``): the best checkpoints by an evaluated value,
kept apart from retention, pointed at by ``best``: the kept set against a plain-Python
reference, the commit protocol over a folder, 2 gloo ranks resumed bitwise, ``ups report``,
and bad input refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_refused
from hypothesis import given, settings
from hypothesis import strategies as st

from ups.core import RunContext, load_config, train
from ups.core.checkpoint import SimpleCheckpointer, SimpleCheckpointOptions
from ups.core.checkpoint._best import KeepBest, admit
from ups.core.testing import assert_bitwise_equal, read_checkpoint, run_ups, tiny_project

EVAL = {"factory": "tiny.py:build_dataset", "options": {"n": 67}, "every_steps": 2}


def reference(values: list[float], keep: KeepBest) -> list[tuple[int, list[int]]]:
    """At each evaluation that enters the best ``count``: its index and the kept indices, best
    first (lower is better with ``min``; a NaN never; a tie goes to the earlier)."""
    sign = 1 if keep.mode == "min" else -1
    saved, kept = [], []
    for index, value in enumerate(values):
        if math.isnan(value):
            continue
        if len(kept) == keep.count and not sign * value < sign * values[kept[-1]]:
            continue
        kept = sorted([*kept, index], key=lambda i: (sign * values[i], i))[: keep.count]
        saved.append((index, kept))
    return saved


keeps = st.builds(
    KeepBest,
    monitor=st.just("val_loss"),
    mode=st.sampled_from(["min", "max"]),
    count=st.integers(1, 4),
)
value_lists = st.lists(
    st.one_of(st.floats(-3, 3, allow_nan=False), st.just(float("nan")), st.just(1.0)),
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(keep=keeps, values=value_lists)
def test_the_kept_best_are_those_of_the_reference(keep: KeepBest, values: list[float]) -> None:
    scores: dict[int, float] = {}
    found = []
    for index, value in enumerate(values):
        kept = admit(scores, index, value, keep)
        if kept is not None:
            scores = kept
            found.append((index, list(kept)))
    assert found == reference(values, keep)


@settings(max_examples=60, deadline=None)
@given(keep=keeps, values=value_lists, keep_last=st.integers(1, 3))
def test_a_folder_keeps_the_best_apart_from_keep_last(
    tmp_path_factory: pytest.TempPathFactory, keep: KeepBest, values: list[float], keep_last: int
) -> None:
    """Save a checkpoint at every evaluation (its value recorded when it enters the best):
    the best survive retention, ``best`` names the first, ``keep_last`` keeps its own."""
    folder = tmp_path_factory.mktemp("run")
    options = SimpleCheckpointOptions(keep_last=keep_last, keep_best=keep)
    checkpointer = SimpleCheckpointer(ctx=RunContext(), directory=folder, options=options)
    scores: dict[int, float] = {}
    for step, value in enumerate(values, 1):
        kept = admit(scores, step, value, keep)
        scores = kept or scores
        checkpointer.save({"x": step}, step=step, metrics={"val_loss": value} if kept else None)
    steps = [c.step for c in checkpointer.committed()]
    newest = [s for s in range(1, len(values) + 1) if s not in scores][-keep_last:]
    assert sorted(steps) == sorted({*scores, *newest})
    pointer = checkpointer.storage.read_pointer("best")
    assert pointer == (f"step-{next(iter(scores))}\n" if scores else None)


# --- training: 2 gloo ranks, resumed bitwise, the report --------------------------------------

KEEP = {"keep_best": {"monitor": "val_loss", "count": 2}, "keep_last": 1}


def best_lines(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "best"]


def test_on_two_gloo_ranks_a_stopped_and_resumed_run_ends_bitwise_as_one_never_stopped(
    tmp_path: Path,
) -> None:
    def run(folder: Path, max_steps: int, resume: str = "none") -> Any:
        config = tiny_project(
            folder,
            eval=EVAL,
            training={"epochs": 4, "max_steps": max_steps},
            checkpoint={"resume": resume, "every_steps": 5, "options": KEEP},
        )
        return train(load_config(config), nproc=2)

    whole = run(tmp_path / "whole", 20)
    run(tmp_path / "halves", 12)  # ends at an evaluation of the whole run: no extra one
    resumed = run(tmp_path / "halves", 20, resume="latest")
    expected, found = (read_checkpoint(r.checkpoint)["state"] for r in (whole, resumed))
    for key in ("model", "optimizer", "best"):
        assert_bitwise_equal(found[key], expected[key], key)
    evals = [r["loss"] for r in whole.eval_metrics]
    best = sorted(range(len(evals)), key=lambda i: (evals[i], i))[:2]
    assert list(expected["best"]) == [2 * (i + 1) for i in best]  # evaluations every 2 steps
    folders = {}
    for name in ("whole", "halves"):
        checkpoints = tmp_path / name / "runs" / "tiny" / "checkpoints"
        folders[name] = sorted(p.name for p in checkpoints.glob("step-*"))
        assert (checkpoints / "best").read_text() == f"step-{2 * (best[0] + 1)}\n"
        assert best_lines(tmp_path / name / "runs" / "tiny") == best_lines(
            tmp_path / "whole" / "runs" / "tiny"
        )
    assert folders["whole"] == folders["halves"]
    assert folders["whole"] == sorted(
        {f"step-{2 * (i + 1)}" for i in best} | {f"step-{whole.steps}"}
    )
    report = run_ups("report", str(tmp_path / "whole" / "runs" / "tiny"))
    row = next(line for line in report.stdout.splitlines() if line.startswith("best checkpoint"))
    assert row.split()[2:5] == ["step", f"{2 * (best[0] + 1)},", "val_loss"], report.stdout


# --- bad input: one line, exit 2, before any rank starts ---------------------------------------


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"checkpoint": {"options": {"keep_best": {"monitor": "val_los"}}}, "eval": EVAL},
            "ups: error: checkpoint.options.keep_best.monitor: 'val_los' is not reported by the "
            "run's evaluation; it reports: val_loss, val_samples; did you mean 'val_loss'?",
        ),
        (
            {"checkpoint": {"options": {"keep_best": {"monitor": "val_loss"}}}},
            "ups: error: checkpoint.options.keep_best: ranks checkpoints by an evaluated value, "
            "and this run has no evaluation (eval: null); set eval, or drop keep_best",
        ),
        (
            {"checkpoint": {"options": {"keep_best": {"monitor": "val_loss", "count": 0}}}},
            "ups: error: checkpoint.options.keep_best.count: 0 is not allowed",
        ),
        (
            {"checkpoint": {"options": {"keep_best": {"mode": "min"}}}},
            "ups: error: checkpoint.options.keep_best.monitor: is required",
        ),
    ],
)
@pytest.mark.parametrize("command", ["validate", "train"])
def test_bad_keep_best_input_is_one_line_and_exit_2(
    tmp_path: Path, sections: dict[str, Any], message: str, command: str
) -> None:
    result = run_ups(command, str(tiny_project(tmp_path, **sections)), cwd=tmp_path)
    assert_refused(result, message, tmp_path)
