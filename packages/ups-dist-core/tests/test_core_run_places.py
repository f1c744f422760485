"""Where a run writes is checked before any rank starts (issue 26, items 3 and 5): a
``run.name`` that would leave ``run.output_dir`` is refused, and so are a run folder and a
checkpoint folder that cannot be written, by ``ups validate`` and by ``ups train``'s checks,
in one line with exit status 2; checking leaves nothing behind.

A read-only place is a read-only tmpfs (:mod:`mounts`): root writes through chmod."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ups.core import ConfigError, config_from_mapping
from ups.core.config._config import RunConfig
from ups.core.testing import tiny_project

pytest_plugins = ["mounts"]  # the tmpfs fixture

if TYPE_CHECKING:
    from mounts import Tmpfs

Ups = Callable[..., subprocess.CompletedProcess[str]]


def said(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines of stderr that are not JSON log records."""
    return [line for line in result.stderr.splitlines() if not line.startswith("{")]


def assert_one_usage_line(result: subprocess.CompletedProcess[str], *parts: str) -> str:
    """Exit status 2 and a single ``ups: error:`` line holding every part; return it."""
    assert result.returncode == 2, result.stderr[-3000:]
    lines = said(result)
    assert len(lines) == 1 and lines[0].startswith("ups: error: "), result.stderr[-3000:]
    for part in parts:
        assert part in lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


# ---------------------------------------------------------------------------------------------
# run.name


@pytest.mark.parametrize("name", ["../escaped", "a/b", "/tmp/elsewhere", ".", "..", "", "a\\b"])
def test_a_run_name_that_is_not_one_folder_name_is_refused(
    ups: Ups, tmp_path: Path, name: str
) -> None:
    config = tiny_project(tmp_path / "p")
    line = assert_one_usage_line(
        ups("validate", str(config), "-o", f"run.name={json.dumps(name)}"),
        f"run.name: {name!r} is not allowed: a run's name is one folder's name inside "
        "run.output_dir: not empty, '.' or '..', and without '/', '\\' or NUL",
    )
    assert line.startswith(f"ups: error: {config}: ")
    with pytest.raises(ConfigError, match=r"^run\.name: "):
        config_from_mapping(
            {"model": {"factory": "m:f"}, "data": {"factory": "d:f"}, "run": {"name": name}}
        )
    with pytest.raises(ValueError, match="one folder's name"):
        RunConfig(name=name)


def test_training_under_a_name_with_dot_dot_writes_nothing_outside_the_output_dir(
    ups: Ups, tmp_path: Path
) -> None:
    config = tiny_project(tmp_path / "p")
    result = ups("train", str(config), "-o", "run.name=../escaped")
    assert_one_usage_line(result, "run.name: '../escaped' is not allowed")
    assert not (tmp_path / "p" / "escaped").exists()


@pytest.mark.parametrize("name", ["pde-1", "run.2", "a..b", "..hidden"])
def test_a_name_of_one_folder_is_allowed(tmp_path: Path, name: str) -> None:
    config = config_from_mapping(
        {"model": {"factory": "m:f"}, "data": {"factory": "d:f"}, "run": {"name": name}}
    )
    assert config.run_dir == Path("runs") / name


# ---------------------------------------------------------------------------------------------
# A folder that cannot be written


def test_validating_makes_no_folder_and_leaves_no_probe(ups: Ups, tmp_path: Path) -> None:
    config = tiny_project(tmp_path / "p")
    fresh = ups("validate", str(config), "-o", f"run.output_dir={tmp_path / 'new' / 'deeper'}")
    assert fresh.returncode == 0, fresh.stderr
    assert not (tmp_path / "new").exists()
    (tmp_path / "runs" / "tiny" / "checkpoints").mkdir(parents=True)
    there = ups("validate", str(config), "-o", f"run.output_dir={tmp_path / 'runs'}")
    assert there.returncode == 0, there.stderr
    left = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "runs").rglob("*"))
    assert left == ["runs/tiny", "runs/tiny/checkpoints"]


def test_a_file_where_the_checkpoint_folder_goes_is_refused_before_training(
    ups: Ups, tmp_path: Path
) -> None:
    """The run's folder is writable, its ``checkpoints`` is a file: the run would train to
    the end (``every_steps: null``), then lose everything at its only save."""
    config = tiny_project(tmp_path, checkpoint={"every_steps": None})
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    (tmp_path / "runs" / "tiny" / "checkpoints").write_text("not a folder")
    message = (
        f"run.output_dir: the checkpoints' folder {tmp_path}/runs/tiny/checkpoints cannot be "
        f"made: {tmp_path}/runs/tiny/checkpoints is a file, not a folder"
    )
    assert_one_usage_line(ups("validate", str(config)), message)
    assert_one_usage_line(ups("train", str(config)), message)
    assert not (tmp_path / "runs" / "tiny" / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.slow
def test_a_read_only_output_dir_is_refused_before_any_rank_starts(
    tmpfs: Tmpfs, tmp_path: Path
) -> None:
    config = tiny_project(tmp_path)
    (tmp_path / "ro").mkdir()
    output_dir = f"run.output_dir={tmp_path / 'ro' / 'runs'}"
    message = (
        f"run.output_dir: the run's folder {tmp_path}/ro/runs/tiny cannot be written: "
        f"Read-only file system (at {tmp_path}/ro); allowed: a folder this user can create "
        "files in"
    )
    for command in (("validate",), ("train", "--nproc", "2")):
        result = tmpfs.ups(tmp_path / "ro", *command, str(config), "-o", output_dir, options="ro")
        assert_one_usage_line(result, message)
        assert '"event": "training"' not in result.stderr  # no rank started


@pytest.mark.slow
def test_a_read_only_checkpoint_folder_is_refused_before_any_rank_starts(
    tmpfs: Tmpfs, tmp_path: Path
) -> None:
    """The run's folder is writable; a read-only filesystem is mounted on its
    ``checkpoints`` folder. Before the check, the run trained, then failed at its first save."""
    config = tiny_project(tmp_path, checkpoint={"every_steps": 2})
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    checkpoints.mkdir(parents=True)
    result = tmpfs.ups(checkpoints, "train", str(config), "--nproc", "2", options="ro")
    assert_one_usage_line(
        result,
        f"run.output_dir: the checkpoints' folder {checkpoints} cannot be written: Read-only "
        "file system; allowed: a folder this user can create files in",
    )
    assert not (tmp_path / "runs" / "tiny" / "metrics.jsonl").exists()
