"""The ups command, run as users run it: a subprocess, its exit status, stdout and stderr."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Result

from ups.core.testing import run_ups as ups


def test_validate_accepts_a_good_config(project: Path) -> None:
    result = ups("validate", str(project / "run.yaml"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{project / 'run.yaml'}: ok"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "training.epoch=2",
            "training.epoch: unknown key; allowed: accumulation_steps, batch_size, compile, "
            "ema, epochs, grad_clip_norm",
        ),
        ("sampler.name=torc", "sampler.name: unknown sampler 'torc'; available: "),
        ("model.factory=tiny.py:nope", "model.factory: "),
        ("model.factory=no_such_pkg.mod:f", "model.factory: cannot import 'no_such_pkg.mod'"),
        (
            "checkpoint.options.keep_last=0",
            "checkpoint.options.keep_last: 0 is not allowed: must be >= 1",
        ),
        ("distributed.backend=nccl", "distributed.backend: 'nccl' needs a CUDA device per process"),
    ],
)
def test_bad_config_is_one_line_and_exit_2(project: Path, override: str, message: str) -> None:
    result = ups("validate", str(project / "run.yaml"), "-o", override)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ups: error: ")
    assert message in lines[0]
    if message.startswith("training.epoch:"):
        assert lines[0].endswith("did you mean 'epochs'?")
    assert "Traceback" not in result.stderr


def test_a_model_factory_that_is_not_a_module_is_a_usage_error(project: Path) -> None:
    result = ups("train", str(project / "run.yaml"), "-o", "model.factory=tiny.py:not_a_model")
    assert result.returncode == 2
    assert result.stderr.strip() == "ups: error: model.factory: returned int, not a torch.nn.Module"
    assert "Traceback" not in result.stderr


def test_usage_mistakes_exit_2(tmp_path: Path) -> None:
    assert ups("nonsense").returncode == 2
    missing = ups("train", str(tmp_path / "missing.yaml"))
    assert missing.returncode == 2
    assert missing.stderr.startswith("ups: error: cannot read config file ")


def test_multi_task_data_on_two_ranks_warns_about_the_sampler(project: Path) -> None:
    result = ups("validate", str(project / "run.yaml"), "--nproc", "2", "-o", "data.tasks=[a, b]")
    assert result.returncode == 0
    warnings = [json.loads(line) for line in result.stderr.splitlines()]
    assert any("treats the 2 tasks of data.tasks as one flat list" in w["event"] for w in warnings)


def test_plugins_lists_the_builtins() -> None:
    result = ups("plugins")
    assert result.returncode == 0
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows[0] == ["FAMILY", "NAME", "PLUGIN", "DISTRIBUTION", "STATUS", "DESCRIPTION"]
    torch_row = ["sampler", "torch", "ups-dist-core", "ups-dist-core", "0.1.0", "enabled"]
    assert [*torch_row, "torch.utils.data.DistributedSampler"] in rows  # its description last
    rows = [row[:6] for row in rows]
    assert ["checkpoint", "simple", "ups-dist-core", "ups-dist-core", "0.1.0", "enabled"] in rows


def test_train_on_one_process_and_again_on_the_complete_run(project: Path) -> None:
    """Run again with ``resume: latest``, a run that reached its end (here ``max_steps``,
    mid-epoch) says it is complete, and trains, evaluates and saves nothing more."""
    train = ("train", str(project / "run.yaml"), "-o", "training.max_steps=4")
    resume = ("-o", "checkpoint.resume=latest", "-o", "eval.factory=tiny.py:build_dataset")
    result = ups(*train, *resume)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stderr.splitlines()]
    assert events[-1]["event"] == "done" and events[-1]["steps"] == 4
    assert "rank" not in events[-1]  # one process: no rank field
    run = project / "runs" / "tiny"
    files = {
        p: p.read_bytes()
        for p in run.rglob("*")
        if p.is_file() and "logs" not in p.parts and p.name != ".lock"
    }
    assert any(p.parent.name == "checkpoints" for p in files) and (run / "metrics.jsonl") in files
    again = ups(*train, *resume)
    assert again.returncode == 0, again.stderr
    events = [json.loads(line)["event"] for line in again.stderr.splitlines()]
    assert events[-2:] == ["resumed", "the run is complete at step 4: nothing left to train"]
    # No new metrics, evaluation or checkpoint.
    now = {
        p: p.read_bytes()
        for p in run.rglob("*")
        if p.is_file() and "logs" not in p.parts and p.name != ".lock"
    }
    assert now == files


def test_max_restarts_sets_its_key_and_a_negative_one_is_a_usage_error(project: Path) -> None:
    result = ups("train", str(project / "run.yaml"), "--max-restarts", "-1")
    assert result.returncode == 2
    assert "distributed.max_restarts: -1 is not allowed: must be >= 0" in result.stderr


DUPLICATE = """run:
  name: tiny
  seed: 1
  log_every: 2
  seed: 2
"""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("train", "bytes.yaml"),
            "bytes.yaml: not a YAML text file: byte 0 is not UTF-8 (invalid start byte)",
        ),
        (
            ("validate", "twice.yaml"),
            "twice.yaml: not valid YAML: the key 'seed' is given twice in one mapping, on lines 3 and 5; keep one",
        ),
        (("train", "run.yaml", "--nproc", "0"), "argument --nproc: must be >= 1, not 0"),
        (("train", "run.yaml", "--nproc=-3"), "argument --nproc: must be >= 1, not -3"),
        (("validate", "run.yaml", "--nproc", "0"), "argument --nproc: must be >= 1, not 0"),
        (
            ("train", "run.yaml", "--nproc", "2", "-o", "run.output_dir=a_file/runs"),
            "run.output_dir: the run's folder a_file/runs/tiny cannot be made: a_file is a file, "
            "not a folder",
        ),
    ],
)
def test_bad_input_that_got_through_is_one_line_and_exit_2(
    project: Path, ups: Callable[..., Result], args: tuple[str, ...], message: str
) -> None:
    """In this process (``ups``: :func:`ups.core.cli._main.main`): each is refused before any rank
    starts, with one line naming the file, key or flag."""
    (project / "bytes.yaml").write_bytes(bytes([0xFF, 0xFE, 0x00, 0x9C]) * 64)
    (project / "twice.yaml").write_text(DUPLICATE)
    (project / "a_file").write_text("")
    result = ups(*args, cwd=project)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line == f"ups: error: {message}"
    assert not (project / "runs").exists()


def test_more_processes_than_cores_is_one_warning(
    project: Path, ups: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UPS_LOG_FORMAT", "json")
    cores = len(os.sched_getaffinity(0))
    result = ups("validate", str(project / "run.yaml"), "--nproc", str(cores + 1))
    assert result.returncode == 0, result.stderr
    (warning,) = [json.loads(line)["event"] for line in result.stderr.splitlines()]
    assert warning.startswith(f"distributed.nproc: {cores + 1} processes on {cores} CPU cores")
