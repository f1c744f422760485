"""The backends' probes (issue 26, item 3): before any rank starts, ``ups validate`` and
``ups train`` check that checkpoints can be written where the backend keeps them, a folder by
a probe file, a store by a probe object (a real S3 API: the moto server of :mod:`s3`), and
refuse in one line with exit status 2; a probe leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ups.core.testing import run_ups, tiny_project

if TYPE_CHECKING:
    from s3 import S3Prefix

pytest_plugins = ["s3"]  # the moto server and the `s3` fixture


def fsspec_project(folder: Path, url: str, storage_options: dict[str, Any]) -> Path:
    return tiny_project(
        folder,
        checkpoint={
            "name": "fsspec",
            "options": {"url": url, "storage_options": storage_options},
        },
    )


def one_usage_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a usage error prints, with exit status 2."""
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert len(lines) == 1 and lines[0].startswith("ups: error: "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return lines[0].removeprefix("ups: error: ")


def test_a_writable_bucket_passes_and_keeps_no_probe_object(tmp_path: Path, s3: S3Prefix) -> None:
    config = fsspec_project(tmp_path, s3.url, s3.storage_options)
    result = run_ups("validate", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    assert s3.objects() == []


@pytest.mark.slow
def test_a_bucket_that_cannot_be_written_is_refused_before_any_rank_starts(
    tmp_path: Path, s3: S3Prefix
) -> None:
    url = "s3://no-such-bucket/run1/checkpoints"
    config = fsspec_project(tmp_path, url, s3.storage_options)
    for command in (("validate",), ("train", "--nproc", "2")):
        line = one_usage_line(run_ups(*command, str(config)))
        assert line.startswith(
            f"checkpoint.options.url: checkpoints cannot be written under {url}: writing and "
            f"deleting the probe object {url}/.ups-probe-"
        ), line
        assert "FileNotFoundError: The specified bucket does not exist" in line, line
    assert not (tmp_path / "runs" / "tiny").exists()  # no rank started


@pytest.mark.parametrize("name", ["local", "sharded"])
def test_a_file_where_the_checkpoint_folder_goes_is_refused(tmp_path: Path, name: str) -> None:
    config = tiny_project(tmp_path, checkpoint={"name": name})
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    checkpoints.parent.mkdir(parents=True)
    checkpoints.write_text("not a folder")
    assert one_usage_line(run_ups("validate", str(config))) == (
        f"run.output_dir: the checkpoints' folder {checkpoints} cannot be made: {checkpoints} is "
        "a file, not a folder"
    )


def test_an_fsspec_path_under_a_file_is_refused(tmp_path: Path) -> None:
    """A relative path is under the run's folder: there, ``ckpt`` is a file."""
    config = fsspec_project(tmp_path, "ckpt/checkpoints", {})
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    (tmp_path / "runs" / "tiny" / "ckpt").write_text("not a folder")
    folder = tmp_path / "runs" / "tiny" / "ckpt" / "checkpoints"
    assert one_usage_line(run_ups("validate", str(config))) == (
        f"checkpoint.options.url: the checkpoints' folder {folder} cannot be made: "
        f"{tmp_path / 'runs' / 'tiny' / 'ckpt'} is a file, not a folder"
    )


def test_the_probes_import_no_torch() -> None:
    """``ups validate`` of a config whose factories import no torch answers without it."""
    probe = (
        "import sys; from ups.ckpt import plugin, _store; from ups.core import builtins; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    assert found.stdout == "[]\n"
