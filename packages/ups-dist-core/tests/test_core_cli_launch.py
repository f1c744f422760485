"""``ups launch``, ``status``, ``logs`` and ``cancel`` through a small launcher plugin installed
for the test (ups-cloud's real launchers are tested in ups-cloud, with the command run in
processes of its own). Here the command runs in the test's process (``main``), each call afresh
from the files, as from a later shell; one test runs it as a process too."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from ups.core.testing import install_plugin, run_ups, tiny_project

Result = subprocess.CompletedProcess[str]

FAKE = '''
import json
import pathlib

import attrs

from ups.core import LauncherPlugin, UsageError, hookimpl


@attrs.frozen(kw_only=True)
class Options:
    token_env: str = "FAKE_TOKEN"
    end: str = "SUCCEEDED"
    fail: str = ""


class Fake:
    """A job is a JSON file: RUNNING for its first two status polls, then options.end."""

    def __init__(self, *, options):
        self.options = options

    def dry_run(self, request):
        return (
            f"POST /jobs config={request.config} nproc={request.nproc_per_node} "
            f"nnodes={request.nnodes} overrides={list(request.overrides)} "
            f"token=${self.options.token_env}"
        )

    def submit(self, request):
        if self.options.fail == "error":
            raise RuntimeError("the API said no")
        if self.options.fail == "usage":
            raise UsageError("no such GPU 'H1000'")
        path = pathlib.Path(request.run_dir, "fake-job.json").resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"end": self.options.end, "polls": 0}))
        return str(path)

    def _job(self, handle):
        return json.loads(pathlib.Path(handle).read_text())

    def status(self, handle):
        job = self._job(handle)
        job["polls"] += 1
        pathlib.Path(handle).write_text(json.dumps(job))
        return "RUNNING" if job["polls"] < 3 and job["end"] != "CANCELLED" else job["end"]

    def logs(self, handle):
        return "".join(f"line {i}\\n" for i in range(self._job(handle)["polls"]))

    def cancel(self, handle):
        job = self._job(handle)
        job["end"] = "CANCELLED"
        pathlib.Path(handle).write_text(json.dumps(job))


@hookimpl
def ups_launchers():
    return [LauncherPlugin(name="fake", factory=Fake, options=Options)]
'''


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny project in ``tmp_path/project`` (the working directory), its config choosing
    the ``fake`` launcher, which is installed."""
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, "ups-fake-launcher", "ups_fake_launcher", FAKE)
    monkeypatch.syspath_prepend(str(site))
    project = tmp_path / "project"
    tiny_project(project, launch={"name": "fake", "options": {"token_env": "MY_KEY"}})
    # Runs go to ./runs, where a RUN given by name is looked up.
    (project / "run.yaml").write_text(
        (project / "run.yaml").read_text().replace(str(project / "runs"), "runs")
    )
    monkeypatch.chdir(project)
    return project


def one_line_error(result: Result, status: int = 2) -> str:
    assert result.returncode == status, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ups: error: ")
    assert "Traceback" not in result.stderr
    return lines[0].removeprefix("ups: error: ")


def test_dry_run_prints_what_would_be_sent_and_writes_nothing(
    fake: Path, ups: Callable[..., Result]
) -> None:
    result = ups(
        "launch", "run.yaml", "--dry-run", "--nproc", "4", "--nnodes", "2", "-o", "run.seed=1"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "POST /jobs config=run.yaml nproc=4 nnodes=2 overrides=['run.seed=1'] token=$MY_KEY\n"
    )
    assert sorted(p.name for p in fake.iterdir()) == ["run.yaml", "tiny.py"]


def test_launch_then_status_logs_and_cancel_in_later_calls(
    fake: Path, ups: Callable[..., Result]
) -> None:
    result = ups("launch", "run.yaml", "--nproc", "2", "-o", "training.lr=0.1")
    assert result.returncode == 0, result.stderr
    handle = str(fake / "runs" / "fake-job.json")
    record_path = fake / "runs" / "tiny" / "launch.json"
    assert result.stdout.splitlines() == [
        f"launched 'tiny' with fake: {handle}",
        f"record: {Path('runs') / 'tiny' / 'launch.json'}",
        "follow: ups status tiny | ups logs tiny --follow | ups cancel tiny",
    ]
    record = json.loads(record_path.read_text())
    submitted = record.pop("submitted")
    assert submitted.endswith("+00:00")
    assert record == {
        "format": 1,
        "launcher": "fake",
        "options": {"token_env": "MY_KEY"},
        "handle": handle,
        "request": {
            "config": "run.yaml",
            "nproc_per_node": 2,
            "nnodes": 1,
            "overrides": ["training.lr=0.1"],
            "run_dir": "runs",
        },
        "cwd": str(fake),
    }

    status = ups("status", "tiny")
    assert (status.returncode, status.stdout) == (0, "RUNNING\n"), status.stderr
    logs = ups("logs", str(record_path))  # the record's path works too
    assert (logs.returncode, logs.stdout) == (0, "line 0\n"), logs.stderr

    # A running job's record is not replaced.
    again = one_line_error(ups("launch", "run.yaml"))
    assert again.startswith(f"{Path('runs') / 'tiny' / 'launch.json'}: the run's previous job")
    assert "is RUNNING; cancel it" in again

    # --follow prints each line once, until the job ends: 2 polls above, the 3rd ends it.
    follow = ups("logs", "runs/tiny", "--follow", "--interval", "0.05")  # the folder works too
    assert follow.returncode == 0, follow.stderr
    assert follow.stdout == "line 0\nline 1\nline 2\n"
    assert follow.stderr.strip() == "ups: runs/tiny: SUCCEEDED"

    # An ended job's record is replaced by the next launch's.
    assert ups("launch", "run.yaml", "-o", "launch.options.end=FAILED").returncode == 0
    assert json.loads(record_path.read_text())["options"] == {
        "token_env": "MY_KEY",
        "end": "FAILED",
    }
    cancel = ups("cancel", "tiny")
    assert (cancel.returncode, cancel.stdout) == (0, "CANCELLED\n"), cancel.stderr
    follow = ups("logs", "tiny", "-f", "--interval", "0.05")
    assert follow.returncode == 1
    assert follow.stderr.strip() == "ups: tiny: CANCELLED"


def test_a_stopped_job_has_ended_but_is_kept_until_cancelled(
    fake: Path, ups: Callable[..., Result]
) -> None:
    """STOPPED (machines stopped, still billing): --follow returns, saying so; status says so;
    the record, which cancel needs, is not replaced."""
    assert ups("launch", "run.yaml", "-o", "launch.options.end=STOPPED").returncode == 0
    note = "the job has ended, but its machines are kept, and billed, until `ups cancel tiny`"
    follow = ups("logs", "tiny", "--follow", "--interval", "0.05")
    assert follow.returncode == 1
    assert follow.stdout == "line 0\nline 1\nline 2\n"
    assert follow.stderr.strip() == f"ups: tiny: STOPPED: {note} deletes them"
    status = ups("status", "tiny")
    assert (status.returncode, status.stdout) == (0, "STOPPED\n")
    assert status.stderr.strip() == f"ups: tiny: {note} deletes them"
    again = one_line_error(ups("launch", "run.yaml"))
    assert "is STOPPED; cancel it" in again
    cancel = ups("cancel", "tiny")
    assert (cancel.returncode, cancel.stdout, cancel.stderr) == (0, "CANCELLED\n", "")
    assert ups("launch", "run.yaml").returncode == 0


def test_another_launcher_than_the_configs_starts_from_its_defaults(
    fake: Path, ups: Callable[..., Result]
) -> None:
    config = fake / "run.yaml"
    config.write_text(config.read_text().replace("name: fake", "name: elsewhere"))
    result = ups("launch", "run.yaml", "--launcher", "fake", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("token=$FAKE_TOKEN\n")


def test_launcher_failures(fake: Path, ups: Callable[..., Result]) -> None:
    failed = one_line_error(ups("launch", "run.yaml", "-o", "launch.options.fail=error"), status=1)
    assert failed == "launcher 'fake': submit failed: RuntimeError: the API said no"
    refused = one_line_error(ups("launch", "run.yaml", "-o", "launch.options.fail=usage"))
    assert refused == "no such GPU 'H1000'"
    assert not (fake / "runs" / "tiny" / "launch.json").exists()
    bad = one_line_error(ups("launch", "run.yaml", "-o", "launch.options.colour=red"))
    assert bad.startswith("launch.options.colour: unknown key")


def test_launch_needs_a_launcher(tmp_path: Path, ups: Callable[..., Result]) -> None:
    config = tiny_project(tmp_path)
    assert one_line_error(ups("launch", str(config))).startswith(
        "launch.name: no launcher chosen; set launch.name in the config"
    )
    unknown = one_line_error(ups("launch", str(config), "--launcher", "nope", "--dry-run"))
    assert unknown.startswith("launch.name: unknown launcher 'nope'; available: ")
    assert one_line_error(ups("launch", str(config), "--nnodes", "0")) == (
        "argument --nnodes: must be >= 1, not 0"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml", "tiny.py"]


@pytest.mark.parametrize("command", [["status"], ["logs"], ["logs", "--follow"], ["cancel"]])
def test_an_unknown_run_is_one_line(
    tmp_path: Path, command: list[str], ups: Callable[..., Result]
) -> None:
    error = one_line_error(ups(*command[:1], "nope", *command[1:], cwd=tmp_path))
    assert error == (
        "no launched run 'nope': no launch record at nope/launch.json, runs/nope/launch.json; "
        "pass a run's name, its folder or its launch.json"
    )


def test_a_damaged_record_or_a_missing_launcher_is_one_line(
    tmp_path: Path, ups: Callable[..., Result]
) -> None:
    folder = tmp_path / "runs" / "tiny"
    folder.mkdir(parents=True)
    record = folder / "launch.json"
    record.write_text('{"format": 1, "launcher": "local"')
    error = one_line_error(ups("status", "tiny", cwd=tmp_path))
    assert error.startswith(f"{Path('runs/tiny/launch.json')}: not a readable launch record (")

    record.write_text(
        json.dumps(
            {
                "format": 1,
                "launcher": "gone",
                "options": {},
                "handle": "h",
                "request": {
                    "config": "run.yaml",
                    "nproc_per_node": 1,
                    "nnodes": 1,
                    "overrides": [],
                    "run_dir": "runs",
                },
                "cwd": str(tmp_path),
                "submitted": "2025-01-01T00:00:00+00:00",
            }
        )
    )
    error = one_line_error(ups("cancel", str(folder), cwd=tmp_path))
    assert error.startswith(f"{record}: launcher 'gone': launch.name: unknown launcher 'gone'")


def test_the_command_as_a_process(tmp_path: Path) -> None:
    error = one_line_error(run_ups("logs", "nope", "--follow", cwd=tmp_path))
    assert error.startswith("no launched run 'nope': no launch record at nope/launch.json")
