"""A full disk, for real (a small tmpfs, :mod:`mounts`) (issue 26, item 6): a save of
``ups train --nproc 2`` that runs out of space says so on the console, where, and about how
much it needed, and keeps the checkpoints committed before it; the run's files written at the
start (``config.yaml``) are whole or absent, never empty."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ups.core.testing import tiny_project

if TYPE_CHECKING:
    from mounts import Tmpfs

pytest_plugins = ["mounts"]  # the tmpfs fixture

CHECKPOINT_KB = 640
"""About the size of a checkpoint of the tiny model of width 8192 with AdamW's state."""


@pytest.mark.slow
def test_a_save_on_a_full_disk_says_so_and_keeps_the_checkpoint_before(
    tmpfs: Tmpfs, tmp_path: Path
) -> None:
    """Room for one checkpoint and the run's logs, not for two: step 4 commits, step 8 fails."""
    config = tiny_project(
        tmp_path,
        model={"options": {"width": 8192}},
        training={"epochs": 2},  # 4 steps an epoch on 2 ranks
        checkpoint={"every_steps": 4},
    )
    (tmp_path / "mnt").mkdir()
    kept = tmp_path / "kept"
    output_dir = f"run.output_dir={tmp_path / 'mnt'}"
    result = tmpfs.ups(
        tmp_path / "mnt",
        *("train", str(config), "--nproc", "2", "-o", output_dir),
        options=f"size={CHECKPOINT_KB * 3 // 2}k",
        kept=kept,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("ups: ")]
    assert len(lines) == 1, result.stderr[-3000:]  # both ranks say it alike: once
    folder = tmp_path / "mnt" / "tiny" / "checkpoints"
    for line in lines:
        assert re.fullmatch(
            r"ups: rank 0 failed: DiskFullError: saving checkpoint step 8 failed on rank 0: "
            rf"DiskFullError: the disk is full: No space left on device in {folder}, "
            r"where this rank's part of the checkpoint needs about 6\d\d\.\d kB "
            r"\(traceback: .*\)",
            line,
        ), line
    assert "enforce fail" not in result.stderr
    saved = kept / "tiny" / "checkpoints"
    assert sorted(p.name for p in saved.iterdir()) == ["latest", "step-4"]  # nothing staged left
    assert (saved / "latest").read_text() == "step-4\n"
    assert (saved / "step-4" / "COMMIT").is_file()


RUN_FILES = """
import sys
from ups.core import RunContext, load_config
from ups.core.engine._rundir import RunFiles

config = load_config(sys.argv[1], [f"run.output_dir={sys.argv[2]}"])
try:
    RunFiles(config, RunContext())
except OSError as error:
    print(error)
"""
"""Rank 0 of a run starting: its :class:`~ups.core.engine._rundir.RunFiles` writes ``config.yaml``."""


def test_the_config_written_at_the_start_on_a_full_disk_is_not_left_empty(
    tmpfs: Tmpfs, tmp_path: Path
) -> None:
    config = tiny_project(tmp_path)
    (tmp_path / "mnt").mkdir()
    kept = tmp_path / "kept"
    command = (sys.executable, "-c", RUN_FILES, str(config), str(tmp_path / "mnt"))
    result = tmpfs.run(tmp_path / "mnt", *command, options="size=64k", fill=True, kept=kept)
    assert result.returncode == 0, result.stderr[-3000:]
    written = tmp_path / "mnt" / "tiny" / "config.yaml"
    assert result.stdout == f"[Errno 28] No space left on device: '{written}'\n"
    assert [p.name for p in (kept / "tiny").iterdir()] == []  # no config.yaml, no temporary
