"""``ups launch``, ``status``, ``logs`` and ``cancel`` with the ``vastai`` and ``vultr``
launchers, each command a process of its own (as from later shells), against the loopback
servers: a two-machine job from the dry run to its end, a stopped Vultr job (ended, still
billing), a refused key, a key in a file the options name, bad options, and packages missing
here (:mod:`without`). A key planted in the environment or that file appears in nothing any of
them prints or writes, nor in what they send but the authorization header."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, get_type_hints

import pytest
import vultr_server
from vast_server import VastServer

from ups.cloud import LocalLauncher, SlurmLauncher, VastAILauncher, VultrLauncher
from ups.core import TERMINAL, JobState
from ups.core.testing import run_ups, tiny_project, without

VAST_KEY = "planted-vast-key-0c4d81b7e2"


@pytest.fixture
def seen() -> list[str]:
    """Every text the commands printed, for the planted-key check."""
    return []


def ups(project: Path, seen: list[str], *args: str) -> tuple[int, str, str]:
    """:func:`run_ups` in ``project``, what it printed kept in ``seen`` for the key checks."""
    result = run_ups(*args, cwd=project)
    seen += [result.stdout, result.stderr]
    return result.returncode, result.stdout, result.stderr


def written(project: Path) -> list[str]:
    """Every file under ``project`` (launch.json, logs, uploads...), as text."""
    return [p.read_text(errors="replace") for p in project.rglob("*") if p.is_file()]


class Cloud(Protocol):
    """One cloud's loopback server, its launcher options and how its machines end a job."""

    name: str
    key: str
    env: str

    def options(self, project: Path) -> dict[str, Any]: ...

    def live(self) -> int:
        """How many instances exist."""
        ...

    def end_job(self, project: Path) -> None:
        """What the start-up scripts do when training ends well: report, then stop."""
        ...

    def sent(self) -> list[str]:
        """What the launcher sent the server, less the authorization header."""
        ...


class Vast:
    name, key, env = "vastai", VAST_KEY, "VAST_API_KEY"

    def __init__(self, server: VastServer) -> None:
        self.server = server

    def options(self, project: Path) -> dict[str, Any]:
        return {"url": self.server.url, "poll_s": 0.02, "ready_timeout_s": 10.0}

    def live(self) -> int:
        return len(self.server.live())

    def end_job(self, project: Path) -> None:
        for instance_id, row in self.server.instances.items():
            self.server.logs[instance_id] = f"training done on {instance_id}\n"
            row.update(label="ups-exit-0", intended_status="stopped", actual_status="exited")

    def sent(self) -> list[str]:
        return [f"{method} {path} {body!r}" for method, path, _h, body in self.server.requests]


class Vultr:
    name, key, env = "vultr", vultr_server.KEY, "VULTR_API_KEY"

    def __init__(self, server: vultr_server.VultrServer) -> None:
        self.server = server

    def options(self, project: Path) -> dict[str, Any]:
        return {
            "plan": "vcg-a100-1c-6g-4vram",
            "region": "ewr",
            "base_url": self.server.url,
            "poll_s": 0.01,
            "ready_timeout_s": 10,
            "files": ["tiny.py"],
            "upload_url": (project / "uploaded").as_uri(),
        }

    def live(self) -> int:
        return len(self.server.instances)

    def end_job(self, project: Path) -> None:
        for node, folder in enumerate(["", "nodes/1"]):
            (project / "uploaded" / folder).mkdir(parents=True, exist_ok=True)
            (project / "uploaded" / folder / "startup.log").write_text(f"node {node} done\n")
            (project / "uploaded" / folder / "startup.exit").write_text("0\n")
        self.server.stop_all()

    def sent(self) -> list[str]:
        texts = []
        for r in self.server.requests:
            body = r["body"] or {}
            if "user_data" in body:
                texts.append(base64.b64decode(body["user_data"]).decode())
            texts.append(f"{r['method']} {r['path']} {body!r} {r['query']!r}")
        return texts


@pytest.fixture(params=["vastai", "vultr"])
def cloud(request: pytest.FixtureRequest) -> Iterator[Cloud]:
    if request.param == "vastai":
        with VastServer(VAST_KEY) as vast:
            yield Vast(vast)
    else:
        with vultr_server.serve() as vultr:
            yield Vultr(vultr)


@pytest.fixture
def project(tmp_path: Path, cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> Path:
    tiny_project(
        tmp_path,
        distributed={"backend": "gloo"},
        launch={"name": cloud.name, "options": cloud.options(tmp_path)},
    )
    monkeypatch.setenv(cloud.env, cloud.key)
    return tmp_path


def test_a_two_machine_job_from_dry_run_to_its_end_never_shows_the_key(
    project: Path, cloud: Cloud, seen: list[str]
) -> None:
    status, out, err = ups(
        project, seen, "launch", "run.yaml", "--nnodes", "2", "--nproc", "2", "--dry-run"
    )
    assert status == 0, err
    assert out.count("#!/usr/bin/env bash") == 2  # both machines' start-up scripts
    assert "--nnodes 2" in out and "/hour" in out  # multi-node, and a cost estimate
    assert cloud.live() == 0 and not (project / "runs").exists()

    status, out, err = ups(project, seen, "launch", "run.yaml", "--nnodes", "2", "--nproc", "2")
    assert status == 0, err
    handle = out.splitlines()[0].split(": ", 1)[1]
    assert handle.startswith(f"{cloud.name}:") and len(handle.split(",")) == 2
    record = json.loads((project / "runs" / "tiny" / "launch.json").read_text())
    assert (record["launcher"], record["handle"]) == (cloud.name, handle)
    assert record["request"]["nnodes"] == 2
    assert cloud.live() == 2
    assert ups(project, seen, "status", "tiny")[:2] == (0, "RUNNING\n")

    cloud.end_job(project)
    status, out, err = ups(project, seen, "logs", "tiny", "--follow", "--interval", "0.1")
    assert status == 0, err
    assert "done" in out
    assert err.strip().splitlines()[-1] == "ups: tiny: SUCCEEDED"
    assert ups(project, seen, "status", "tiny")[:2] == (0, "SUCCEEDED\n")
    status, out, _ = ups(project, seen, "cancel", "tiny")
    assert (status, cloud.live()) == (0, 0)

    texts = seen + written(project) + cloud.sent()
    assert [t for t in texts if cloud.key in t] == []


def test_a_refused_key_is_one_line_and_leaves_nothing_running(
    project: Path, cloud: Cloud, seen: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cloud.env, "not-the-" + cloud.key)
    status, out, err = ups(project, seen, "launch", "run.yaml", "--nnodes", "2", "--nproc", "2")
    assert status == 2, out + err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "401" in err and "API key" in err, err
    assert cloud.live() == 0
    assert not (project / "runs" / "tiny" / "launch.json").exists()

    monkeypatch.delenv(cloud.env)
    status, _, err = ups(project, seen, "launch", "run.yaml")
    assert status == 2 and f"no API key in ${cloud.env}" in err, err
    assert cloud.live() == 0


@pytest.mark.parametrize("cloud", ["vultr"], indirect=True)
def test_following_a_stopped_job_ends_saying_it_still_bills(
    project: Path, cloud: Vultr, seen: list[str]
) -> None:
    """The machine shut itself down but its upload never came (STOPPED): the job has ended,
    yet the instance is kept, and billed, until ``ups cancel``."""
    status, _, err = ups(project, seen, "launch", "run.yaml", "--nproc", "2")
    assert status == 0, err
    cloud.server.stop_all()
    status, _, err = ups(project, seen, "logs", "tiny", "--follow", "--interval", "0.1")
    billed = "its machines are kept, and billed, until `ups cancel tiny` deletes them"
    assert status == 1, err
    assert err.strip().splitlines()[-1] == f"ups: tiny: STOPPED: the job has ended, but {billed}"
    assert cloud.live() == 1
    status, out, err = ups(project, seen, "status", "tiny")
    assert (status, out) == (0, "STOPPED\n") and billed in err
    assert ups(project, seen, "cancel", "tiny")[:2] == (0, "CANCELLED\n")
    assert cloud.live() == 0
    assert [t for t in seen if cloud.key in t] == []


def test_every_state_of_a_launcher_ends_a_follow_or_is_a_live_one() -> None:
    """``ups logs --follow`` returns at the TERMINAL states and waits out the others: a state
    a launcher adds must be one or the other deliberately."""
    for launcher in (LocalLauncher, SlurmLauncher, VastAILauncher, VultrLauncher):
        assert get_type_hints(launcher.status)["return"] is JobState, launcher
    assert set(JobState) - set(TERMINAL) <= {"PENDING", "RUNNING"}


def test_the_key_can_come_from_a_file_named_in_the_options_and_shows_nowhere(
    project: Path,
    cloud: Cloud,
    seen: list[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``launch.options.api_key_file`` from ``-o`` (a string, as from a config), for the dry
    run, the launch and the commands that follow it from its record."""
    monkeypatch.delenv(cloud.env)
    key_file = tmp_path_factory.mktemp("secrets") / "cloud.key"
    key_file.write_text(cloud.key + "\n")
    named = f"launch.options.api_key_file={key_file}"
    status, out, err = ups(project, seen, "launch", "run.yaml", "-o", named, "--dry-run")
    assert status == 0, err
    # The key was read: vastai searched the offers with it; vultr shows where it comes from.
    assert "# node 0: offer #" in out if cloud.name == "vastai" else f"(from {key_file})" in out
    status, out, err = ups(project, seen, "launch", "run.yaml", "-o", named)
    assert (status, cloud.live()) == (0, 1), err
    assert ups(project, seen, "status", "tiny")[:2] == (0, "RUNNING\n")
    assert ups(project, seen, "cancel", "tiny")[:2] == (0, "CANCELLED\n")
    assert cloud.live() == 0
    texts = seen + written(project) + cloud.sent()
    assert [t for t in texts if cloud.key in t] == []


@pytest.mark.parametrize(
    ("cloud", "options", "message"),
    [
        (
            "vastai",
            ["min_reliability=2"],
            ".min_reliability: 2.0 is not allowed: must be in [0, 1]",
        ),
        ("vastai", ["disk_gb=0"], ".disk_gb: 0.0 is not allowed: must be > 0"),
        ("vastai", ["num_gpus=0"], ".num_gpus: 0 is not allowed: must be >= 1"),
        ("vastai", ["retries=0"], ".retries: 0 is not allowed: must be >= 1"),
        (
            "vultr",
            ["api_key_file=''"],
            ".api_key_file: '' is not allowed: must be the path of a file",
        ),
        ("vultr", ["os_id=1743", "image_id=x"], ": give os_id or image_id, not both"),
    ],
    indirect=["cloud"],
)
def test_a_bad_option_is_one_line_naming_its_key_path(
    project: Path, cloud: Cloud, seen: list[str], options: list[str], message: str
) -> None:
    overrides = [arg for option in options for arg in ("-o", f"launch.options.{option}")]
    status, out, err = ups(project, seen, "launch", "run.yaml", *overrides, "--dry-run")
    assert (status, out, err) == (2, "", f"ups: error: launch.options{message}\n")
    assert cloud.sent() == []


@pytest.mark.parametrize("cloud", ["vastai"], indirect=True)
def test_without_the_vastai_client_launching_says_what_to_install(
    project: Path,
    cloud: Cloud,
    seen: list[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    without(monkeypatch, tmp_path_factory.mktemp("site"), "vastai")
    for dry_run in (["--dry-run"], []):
        status, out, err = ups(project, seen, "launch", "run.yaml", *dry_run)
        assert (status, out) == (2, ""), err
        assert err == (
            "ups: error: the vastai launcher needs the 'vastai' package, which is not installed "
            "here: pip install 'vastai>=1.9.1'\n"
        )
    assert cloud.sent() == [] and not (project / "runs" / "tiny" / "launch.json").exists()


def read_here(url: str, package: str) -> str:
    """What ``ups`` says when ``package`` is missing to read the vultr ``upload_url``."""
    return (
        f"ups: error: launch.options.upload_url: {url!r}: reading it here (ups status, ups "
        f"logs) needs the {package!r} package, which is not installed here: pip install "
        f"{package}\n"
    )


@pytest.mark.parametrize("cloud", ["vultr"], indirect=True)
@pytest.mark.parametrize(
    ("package", "url"), [("s3fs", "s3://bucket/runs/tiny"), ("fsspec", "s3://bucket/runs/tiny")]
)
def test_an_upload_url_vultr_cannot_read_here_is_refused_before_anything_is_created(
    project: Path,
    cloud: Cloud,
    seen: list[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
    package: str,
    url: str,
) -> None:
    """``status`` and ``logs`` read ``upload_url`` here: without the package for it, ``ups
    launch`` (and its dry run) says so, not ``status``, ``logs`` or ``cancel`` once the
    machines run."""
    without(monkeypatch, tmp_path_factory.mktemp("site"), package)
    for dry_run in (["--dry-run"], []):
        status, out, err = ups(
            project, seen, "launch", "run.yaml", "-o", f"launch.options.upload_url={url}", *dry_run
        )
        assert (status, out, err) == (2, "", read_here(url, package))
    assert cloud.sent() == [] and not (project / "runs" / "tiny" / "launch.json").exists()


@pytest.mark.parametrize("cloud", ["vultr"], indirect=True)
def test_a_vultr_job_followed_where_its_upload_cannot_be_read_says_what_to_install(
    project: Path,
    cloud: Cloud,
    seen: list[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Launched where fsspec is installed, then followed from a shell where it is not."""
    status, _, err = ups(project, seen, "launch", "run.yaml")
    assert status == 0, err
    without(monkeypatch, tmp_path_factory.mktemp("site"), "fsspec")
    url = (project / "uploaded").as_uri()
    cloud.end_job(project)  # stopped and uploaded: status would read the upload
    for command in ("status", "logs"):
        assert ups(project, seen, command, "tiny") == (2, "", read_here(url, "fsspec"))
    assert cloud.live() == 1
    status, out, err = ups(project, seen, "cancel", "tiny")
    assert (status, out, err.splitlines(keepends=True)[-1]) == (2, "", read_here(url, "fsspec"))
    assert cloud.live() == 0  # the machines are deleted all the same
