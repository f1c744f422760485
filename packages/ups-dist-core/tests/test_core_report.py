"""``ups report``: a run folder's metrics.jsonl read, summarised and plotted."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ups.core import load_config, train
from ups.core.cli._main import main
from ups.core.config._errors import UsageError
from ups.core.observe._summary import plot, read_metrics, run_name, summary
from ups.core.testing import tiny_project, without

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# A two-task run: reports every 2 steps, evaluations at 4 and 8 (best at 4), throughput and a
# running count of OOM-skipped batches; one null task loss (NaN written as null); a metric of
# the step, acc, reported once.
TWO_TASKS: list[dict[str, Any]] = [
    {"kind": "train", "step": 2, "loss": 2.0, "loss/cls": 3.0, "loss/reg": 1.0, "samples": 64,
     "lr": 0.1, "samples_per_s": 100.0, "step_time_s": 0.3, "oom_skipped": 0},
    {"kind": "train", "step": 4, "loss": 1.0, "loss/cls": 1.5, "loss/reg": None, "samples": 64,
     "lr": 0.1, "samples_per_s": 300.0, "step_time_s": 0.1, "oom_skipped": 1, "acc": 0.5},
    {"kind": "eval", "step": 4, "loss": 0.9, "loss/cls": 1.2, "loss/reg": 0.6, "samples": 20},
    {"kind": "train", "step": 6, "loss": 0.5, "loss/cls": 0.75, "loss/reg": 0.25, "samples": 64,
     "lr": 0.1, "samples_per_s": 200.0, "step_time_s": 0.15, "oom_skipped": 1},
    {"kind": "train", "step": 8, "loss": 0.25, "loss/cls": 0.375, "loss/reg": 0.125,
     "samples": 64, "lr": 0.1, "samples_per_s": 1000.0, "step_time_s": 0.03, "oom_skipped": 3},
    {"kind": "eval", "step": 8, "loss": 1.1, "loss/cls": 1.0, "loss/reg": 1.2, "samples": 20},
]  # fmt: skip

TWO_TASKS_SUMMARY = """\
run             two-tasks
steps           8 (4 training reports, 2 evaluations)
train loss      0.25 (step 8)
train loss/cls  0.375 (step 8)
train loss/reg  0.125 (step 8)
train acc       0.5 (step 4)
eval loss       best 0.9 (step 4), final 1.1 (step 8)
eval loss/cls   best 1 (step 8), final 1 (step 8)
eval loss/reg   best 0.6 (step 4), final 1.2 (step 8)
throughput      250.0 samples/s (median)
oom-skipped     3 batches"""


def write_run(folder: Path, records: list[dict[str, Any]], name: str | None = None) -> Path:
    """A run folder as the engine leaves it: metrics.jsonl (and config.yaml, given a name)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(record) + "\n" for record in records)
    (folder / "metrics.jsonl").write_text(lines)
    if name is not None:
        (folder / "config.yaml").write_text(f"run:\n  name: {name}\n  log_every: 2\n")
    return folder


def titles(figure: Any) -> list[str]:
    return [ax.get_title() for ax in figure.axes]


def check_png(path: Path) -> tuple[int, ...]:
    """Assert ``path`` is a PNG that matplotlib reads back; return its pixel array's shape."""
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 1000
    return tuple(imread(path).shape)


def test_reports_a_two_task_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "two-tasks-run", TWO_TASKS, name="two-tasks")

    assert main(["report", str(run)]) == 0

    out = capsys.readouterr().out
    assert out == f"{TWO_TASKS_SUMMARY}\nplot: {run / 'report.png'}\n"
    height, width, channels = check_png(run / "report.png")
    assert (width, channels) == (800, 4)
    assert height == 1300  # four panels: 1 + 4 * 3 inches at 100 dpi


def test_output_option_writes_the_figure_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path / "run", TWO_TASKS[:2])
    output = tmp_path / "figures" / "loss.png"
    output.parent.mkdir()

    assert main(["report", str(run), "--output", str(output)]) == 0

    check_png(output)
    assert not (run / "report.png").exists()
    # No config.yaml: the folder names the run.
    assert capsys.readouterr().out.splitlines()[0] == "run             run"


def test_panels_follow_the_data(tmp_path: Path) -> None:
    figure = plot(TWO_TASKS, tmp_path / "all.png", "two-tasks")
    assert titles(figure) == ["Training loss", "Training acc", "Evaluation loss", "Throughput"]
    assert figure.get_suptitle() == "ups run: two-tasks"
    train_ax, _, eval_ax, speed_ax = figure.axes
    assert train_ax.get_legend_handles_labels()[1] == ["loss", "loss/cls", "loss/reg"]
    assert eval_ax.get_legend_handles_labels()[1] == ["loss", "loss/cls", "loss/reg"]
    assert (train_ax.get_yscale(), eval_ax.get_yscale()) == ("log", "log")
    assert speed_ax.get_yscale() == "linear"
    assert np.asarray(speed_ax.lines[0].get_ydata()).tolist() == [100.0, 300.0, 200.0, 1000.0]

    # An older file: no evaluations, no samples_per_s; a negative loss keeps the axis linear.
    older = [
        {"kind": "train", "step": 1, "loss": 0.5, "samples": 8, "lr": 0.1},
        {"kind": "train", "step": 2, "loss": -0.5, "samples": 8, "lr": 0.1},
    ]
    figure = plot(read_metrics(write_run(tmp_path / "older", older)), tmp_path / "o.png", "o")
    assert titles(figure) == ["Training loss"]
    assert figure.axes[0].get_yscale() == "linear"
    check_png(tmp_path / "o.png")


def test_summary_of_an_older_run_leaves_out_what_it_lacks(tmp_path: Path) -> None:
    older = [
        {"kind": "train", "step": 5, "loss": 0.75, "samples": 8, "lr": 0.1},
        {"kind": "train", "step": 10, "loss": None, "samples": 8, "lr": 0.1},
    ]
    records = read_metrics(write_run(tmp_path / "run", older))
    assert math.isnan(records[1]["loss"])
    assert summary(records, "old").splitlines() == [
        "run         old",
        "steps       10 (2 training reports, 0 evaluations)",
        "train loss  nan (step 10)",
    ]


def test_a_resumed_run_reports_the_last_line_of_each_step() -> None:
    # Crashed after step 6, resumed from a step-4 checkpoint: steps 6 and 8 written again,
    # and the restarted process counts its OOM skips from zero.
    records = [
        {"kind": "train", "step": 4, "loss": 4.0, "oom_skipped": 2},
        {"kind": "train", "step": 6, "loss": 3.0, "oom_skipped": 5},
        {"kind": "train", "step": 6, "loss": 2.0, "oom_skipped": 1},
        {"kind": "train", "step": 8, "loss": 1.0, "oom_skipped": 1},
    ]
    lines = summary(records, "resumed").splitlines()
    assert lines[1:3] == [
        "steps        8 (3 training reports, 0 evaluations)",
        "train loss   1 (step 8)",
    ]
    assert lines[-1] == "oom-skipped  6 batches"


def test_run_name_comes_from_the_resolved_config(tmp_path: Path) -> None:
    assert run_name(write_run(tmp_path / "folder", TWO_TASKS, name="named")) == "named"
    (tmp_path / "folder" / "config.yaml").write_text("run: [unclosed\n")
    assert run_name(tmp_path / "folder") == "folder"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("", "metrics.jsonl: no metrics in the file"),
        ("\n  \n", "metrics.jsonl: no metrics in the file"),
        ('{"kind": "train", "step": 2, "loss": 1.0}\n{"kind": "tr', "metrics.jsonl:2: not JSON"),
        ('{"kind": "train", "step": 2}\n\n[1, 2]\n', "metrics.jsonl:3: not a JSON object"),
        ('{"step": 2, "loss": 1.0}\n', "metrics.jsonl:1: no 'kind' string"),
        ('{"kind": "train", "loss": 1.0}\n', "metrics.jsonl:1: 'step' is None, not a non-neg"),
        ('{"kind": "eval", "step": 2.5}\n', "metrics.jsonl:1: 'step' is 2.5, not a non-neg"),
        ('{"kind": "eval", "step": 1, "loss/a": "x"}\n', "metrics.jsonl:1: 'loss/a' is 'x', not"),
        ('{"kind": "train", "step": 1, "samples_per_s": true}\n', "1: 'samples_per_s' is True"),
    ],
)
def test_a_bad_metrics_file_is_a_usage_error(tmp_path: Path, content: str, problem: str) -> None:
    (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(UsageError) as caught:
        read_metrics(tmp_path)
    assert str(caught.value).startswith(str(tmp_path / "metrics.jsonl"))
    assert problem in str(caught.value)


def test_cli_names_the_file_and_line_of_a_bad_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path / "run", TWO_TASKS)
    with (run / "metrics.jsonl").open("a") as file:
        file.write('{"kind": "train", "step": 10, "loss": 0.1\n')

    assert main(["report", str(run)]) == 2

    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"ups: error: {run / 'metrics.jsonl'}:7: not JSON")
    assert len(captured.err.splitlines()) == 1
    assert not (run / "report.png").exists()


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda run: None, "{run}: no such run folder"),
        (lambda run: run.mkdir(), "{run}/metrics.jsonl: no such file; is {run} a run folder?"),
    ],
)
def test_cli_rejects_a_folder_without_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: Any, message: str
) -> None:
    run = tmp_path / "missing"
    setup(run)

    assert main(["report", str(run)]) == 2

    assert capsys.readouterr().err == f"ups: error: {message.format(run=run)}\n"


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("nowhere/report.png", "folder {tmp}/nowhere does not exist"),
        ("report.docx", "matplotlib cannot write .docx files; it writes "),
    ],
)
def test_cli_rejects_an_output_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], output: str, message: str
) -> None:
    run = write_run(tmp_path / "run", TWO_TASKS)

    assert main(["report", str(run), "--output", str(tmp_path / output)]) == 2

    err = capsys.readouterr().err
    assert err.startswith(f"ups: error: {tmp_path / output}: ")
    assert message.format(tmp=tmp_path) in err


def without_matplotlib(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` (under :func:`~ups.core.testing.without` matplotlib)."""
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_cli_without_matplotlib_prints_the_table_and_says_what_draws_the_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = write_run(tmp_path / "run", TWO_TASKS, name="two-tasks")
    without(monkeypatch, tmp_path / "site", "matplotlib")
    blocked = without_matplotlib("-c", "import matplotlib")
    assert "ModuleNotFoundError: No module named 'matplotlib'" in blocked.stderr

    done = without_matplotlib("-m", "ups.core", "report", str(run))

    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == (
        f"{TWO_TASKS_SUMMARY}\nplot: not drawn: {run / 'report.png'}: drawing the figure needs "
        "matplotlib: pip install 'ups-dist-core[report]'\n"
    )
    assert not (run / "report.png").exists()

    # A figure asked for by name: the table, then the error.
    output = tmp_path / "loss.png"
    done = without_matplotlib("-m", "ups.core", "report", str(run), "--output", str(output))

    assert (done.returncode, done.stdout) == (2, f"{TWO_TASKS_SUMMARY}\n")
    assert done.stderr == (
        f"ups: error: {output}: drawing the figure needs matplotlib: "
        "pip install 'ups-dist-core[report]'\n"
    )


METRICS = """
def build_metrics():
    def fn(outputs, targets):
        error = (outputs - targets).abs().flatten(1).mean(1)
        return {"mae": error, "max_err": error.max()}

    return fn
"""
"""A ``metrics.factory``: ``mae`` per sample, ``max_err`` one number (``reduce: max``)."""


def test_reports_a_real_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    eval_data = {"factory": "tiny.py:build_dataset", "options": {"n": 16}, "every_steps": 4}
    metrics = {"factory": "metrics.py:build_metrics", "reduce": {"max_err": "max"}}
    (tmp_path / "metrics.py").write_text(METRICS)
    result = train(load_config(tiny_project(tmp_path, eval=eval_data, metrics=metrics)))
    run = tmp_path / "runs" / "tiny"
    capsys.readouterr()

    assert main(["report", str(run)]) == 0

    lines = capsys.readouterr().out.splitlines()
    table = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines[:-1])
    assert table["run"] == "tiny"
    assert table["steps"] == "8 (4 training reports, 2 evaluations)"
    assert table["train loss"] == f"{result.metrics[-1]['loss']:.4g} (step 8)"
    best = min(result.eval_metrics, key=lambda m: m["loss"])["loss"]
    final = result.eval_metrics[-1]["loss"]
    assert table["eval loss"].startswith(f"best {best:.4g} (step ")
    assert table["eval loss"].endswith(f"final {final:.4g} (step 8)")
    # one task: mae, per sample, has no rows per task; max_err is one number a report
    for name in ("mae", "max_err"):
        assert table[f"train {name}"] == f"{result.metrics[-1][name]:.4g} (step 8)"
        assert table[f"eval {name}"] == f"final {result.eval_metrics[-1][name]:.4g} (step 8)"
    assert lines[-1] == f"plot: {run / 'report.png'}"
    check_png(run / "report.png")

    # What the engine writes decides the panels: throughput only where it is recorded.
    records = read_metrics(run)
    figure = plot(records, tmp_path / "again.png", "tiny")
    throughput = any("samples_per_s" in r for r in records)
    families = ("loss", "max_err", "mae")  # in the order metrics.jsonl holds them
    expected = [f"{kind} {family}" for kind in ("Training", "Evaluation") for family in families]
    expected += ["Throughput"] * throughput
    expected += ["Step time outside communication"] * any(r["kind"] == "phases" for r in records)
    assert titles(figure) == expected
    assert ("throughput" in table) == throughput


def test_every_metric_of_the_step_gets_rows_and_a_panel(tmp_path: Path) -> None:
    # a step's per-sample metric (nrmse) is reported overall and per task, like the loss; a
    # number (max_err, reduce: max) once a report; what the engine says about the run is not
    # a metric (samples, lr, grad_norm, comm_*, ...)
    records = [
        {"kind": "train", "step": s, "loss": 1 / s, "loss/a": 1 / s, "loss/b": 2 / s,
         "nrmse": 0.5 / s, "nrmse/a": 0.4 / s, "nrmse/b": 0.6 / s, "max_err": 3.0 + s,
         "samples": 8, "lr": 0.1, "grad_norm": 2.0, "comm_bytes": 8.0, "comm_b0_s": 0.1}
        for s in (2, 4)
    ] + [{"kind": "eval", "step": 4, "loss": 0.3, "samples": 20, "nrmse": 0.2, "nrmse/a": 0.1,
          "nrmse/b": 0.3, "max_err": 0.5}]  # fmt: skip
    lines = summary(records, "tasks").splitlines()
    assert [line.split()[1] for line in lines[2:]] == [
        *("loss", "loss/a", "loss/b", "nrmse", "nrmse/a", "nrmse/b", "max_err"),
        *("loss", "nrmse", "nrmse/a", "nrmse/b", "max_err"),
    ]
    assert "train nrmse/b  0.15 (step 4)" in lines
    assert "train max_err  7 (step 4)" in lines
    assert "eval nrmse/a   final 0.1 (step 4)" in lines
    assert "eval max_err   final 0.5 (step 4)" in lines
    figure = plot(records, tmp_path / "t.png", "tasks")
    assert titles(figure) == [
        "Training loss",
        "Training nrmse",
        "Training max_err",
        "Evaluation loss",
        "Evaluation nrmse",
        "Evaluation max_err",
    ]
    assert figure.axes[2].get_legend_handles_labels()[1] == ["max_err"]
    assert figure.axes[1].get_legend_handles_labels()[1] == ["nrmse", "nrmse/a", "nrmse/b"]
    check_png(tmp_path / "t.png")
