"""A fresh run's folder: launchers' files about the job are no earlier run, and stay."""

from __future__ import annotations

from pathlib import Path

from ups.core.engine._rundir import _claim


def test_a_folder_of_launcher_files_alone_is_no_earlier_run(tmp_path: Path) -> None:
    # what ups-cloud's SLURM launcher writes before the ranks start (the job's output is named
    # by its job id), and ups launch's record
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("slurm.sbatch", "slurm-7.out", "launch.json"):
        (folder / name).write_text(name)
    _claim(folder, fresh=True).release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_an_earlier_run_is_moved_aside_and_the_launcher_files_stay(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("{}\n")
    (folder / "slurm-8.out").write_text("this job's output")
    _claim(folder, fresh=True).release()
    assert sorted(p.name for p in (tmp_path / "run.1").iterdir()) == [
        "checkpoints",
        "metrics.jsonl",
    ]
    assert [p.name for p in folder.iterdir() if p.name != ".lock"] == ["slurm-8.out"]
