"""The ``slurm`` launcher: its batch script, and jobs it submits to a real single-node SLURM
that the tests start (:mod:`slurm_cluster`: munged, slurmctld and slurmd as root).

Without SLURM installed the cluster tests skip, unless ``UPS_REQUIRE_SERVICES`` is set (as in
CI), where they fail.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import slurm_cluster  # tests/slurm_cluster.py, beside this file
from hypothesis import assume, given
from hypothesis import strategies as st
from launched import Tidy, cancelling, tiny

from ups.cloud import SlurmLauncher, SlurmOptions
from ups.cloud._slurm import TIME_FORMATS
from ups.core import LaunchRequest, UsageError
from ups.core.testing import events, run_ups, wait_for


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm_cluster.Cluster]:
    reason = slurm_cluster.unavailable()
    if reason is not None:
        if os.environ.get("UPS_REQUIRE_SERVICES"):
            pytest.fail(f"UPS_REQUIRE_SERVICES is set but {reason}")
        pytest.skip(reason)
    started = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def slurm_env(
    cluster: slurm_cluster.Cluster, monkeypatch: pytest.MonkeyPatch
) -> slurm_cluster.Cluster:
    """The test cluster, made the one SLURM's clients (and the launcher) talk to."""
    for key, value in cluster.env.items():
        monkeypatch.setenv(key, value)
    return cluster


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return tiny(tmp_path)


class TidySlurm(Tidy, SlurmLauncher):
    """A slurm launcher that remembers its jobs."""


@pytest.fixture
def launcher(slurm_env: slurm_cluster.Cluster) -> Iterator[TidySlurm]:
    with cancelling(TidySlurm(options=SlurmOptions(cancel_timeout_s=30))) as launcher:
        yield launcher


def processes_mentioning(text: str) -> list[int]:
    """Living processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if text in cmdline and stat[stat.rindex(")") + 2] not in "ZX":
            found.append(int(entry.name))
    return found


# -- the batch script -------------------------------------------------------------------------


def test_dry_run_shows_the_sbatch_command_and_the_script(project: Path) -> None:
    launcher = SlurmLauncher(
        options=SlurmOptions(
            partition="gpu", account="proj-1", time="01:30:00", gpus_per_node=4,
            cpus_per_task=32, mem="128G", signal_seconds=120, requeue=True,
            python="/opt/py/bin/python3", extra=["--qos=high", "--constraint=a100 & ib"],
        )
    )  # fmt: skip
    request = LaunchRequest(
        config=project / "run.yaml",
        nproc_per_node=4,
        nnodes=2,
        overrides=("training.lr=3e-4", "run.name=a b", "distributed.max_restarts=2"),
        run_dir=project / "jobs",
    )
    text = launcher.dry_run(request)
    folder = project / "jobs" / "a b"
    first, second, *script = text.splitlines()
    assert shlex.split(first) == [
        "#", "sbatch", "--parsable", f"--output={folder}/slurm-%j.out",
        f"--error={folder}/slurm-%j.out", f"{folder}/slurm.sbatch",
    ]  # fmt: skip
    assert second == f"# {folder}/slurm.sbatch:"
    assert script[0] == "#!/bin/bash"
    directives = [line.removeprefix("#SBATCH ") for line in script if line.startswith("#SBATCH")]
    assert directives == [
        "--job-name=ups-a_b", "--nodes=2", "--ntasks-per-node=1", "--partition=gpu",
        "--account=proj-1", "--time=01:30:00", "--gpus-per-node=4", "--cpus-per-task=32",
        "--mem=128G", "--signal=B:USR1@120", "--requeue", "--open-mode=append",
        "--qos=high", "--constraint=a100 & ib",
    ]  # fmt: skip
    [srun] = [line for line in script if line.startswith("srun ")]
    assert srun.endswith(" &")
    assert shlex.split(srun.removesuffix(" &")) == [
        "srun", "--kill-on-bad-exit=1", "--cpus-per-task=32",
        "bash", "-c", 'trap "" USR1; exec "$@"', "ups-agent",
        "/opt/py/bin/python3", "-m", "torch.distributed.run",
        "--nnodes", "$SLURM_NNODES", "--rdzv-endpoint", "$head_node:$port",
        "--rdzv-id", "$SLURM_JOB_ID", "--max-restarts", "2", "--nproc-per-node", "4",
        "--rdzv-backend", "c10d", "-m", "ups.core", "train", str(project / "run.yaml"),
        "-o", "checkpoint.resume=latest", "-o", "training.lr=3e-4", "-o", "run.name=a b",
        "-o", "distributed.max_restarts=2",
    ]  # fmt: skip
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script
    assert "'run.name=a b'" in srun  # quoted for the shell
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert "port=$((20000 + SLURM_JOB_ID % 20000))" in script
    assert "trap on_notice USR1" in script
    assert '    scancel --signal=USR1 "$SLURM_JOB_ID"' in script
    assert '    scontrol requeue "$SLURM_JOB_ID"' in script
    assert not folder.exists()  # a dry run writes nothing


def test_defaults_ask_for_little_and_no_requeue(project: Path) -> None:
    launcher = SlurmLauncher(options=SlurmOptions(rdzv_port=29400))
    script = launcher.dry_run(LaunchRequest(config=project / "run.yaml")).splitlines()
    directives = [line for line in script if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=ups-tiny", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1",
        "#SBATCH --no-requeue",
    ]  # fmt: skip
    assert "port=29400" in script
    assert not any("scontrol requeue" in line for line in script)
    assert f"{shlex.quote(sys.executable)} -m torch.distributed.run" in "\n".join(script)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"partition": "a b"}, "one word"),
        ({"time": "1:00\n#SBATCH --x"}, "must be a SLURM time"),
        ({"extra": ["--qos=a\n--b"]}, "one non-empty line"),
        ({"gpus_per_node": -1}, "must be >= 0"),
    ],
)
def test_bad_options_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SlurmOptions(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize("time", ["4hours", "4 hours", "04:00:00 ", "1:2:3:4", "-5", "4h"])
def test_a_time_sbatch_does_not_read_is_one_line_naming_its_forms(project: Path, time: str) -> None:
    """The value once, and the forms sbatch takes (it would refuse the job, or worse, read
    another time than meant)."""
    result = run_ups(
        "launch", "run.yaml", "--launcher", "slurm", "--dry-run",
        "-o", f"launch.options.time='{time}'", cwd=project,
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr == (
        f"ups: error: launch.options.time: {time!r} is not allowed: must be a SLURM time: "
        f"{TIME_FORMATS}\n"
    )


_NUMBER = st.integers(0, 10_000).map(str)


@given(
    time=st.one_of(
        st.tuples(_NUMBER, st.lists(_NUMBER, max_size=2)).map(lambda t: ":".join([t[0], *t[1]])),
        st.tuples(_NUMBER, _NUMBER, st.lists(_NUMBER, max_size=2)).map(
            lambda t: f"{t[0]}-" + ":".join([t[1], *t[2]])
        ),
        st.sampled_from(["UNLIMITED", "unlimited", "INFINITE"]),
    )
)
def test_every_form_of_sbatch_time_is_written_as_given(time: str) -> None:
    script = SlurmLauncher(options=SlurmOptions(time=time)).script(
        LaunchRequest(config=Path("x")), "x"
    )
    assert f"\n#SBATCH --time={time}\n" in script


@given(time=st.text(min_size=1))
def test_a_time_with_any_other_character_is_refused(time: str) -> None:
    assume(re.search(r"[^0-9:-]", time) and time.lower() not in ("unlimited", "infinite"))
    with pytest.raises(ValueError, match="must be a SLURM time"):
        SlurmOptions(time=time)


def test_bad_requests_and_handles_are_usage_errors(project: Path) -> None:
    launcher = SlurmLauncher(options=SlurmOptions())
    with pytest.raises(UsageError, match="nproc_per_node must be >= 1, not 0"):
        launcher.dry_run(LaunchRequest(config=project / "run.yaml", nproc_per_node=0))
    with pytest.raises(UsageError, match="cannot read config file"):
        launcher.dry_run(LaunchRequest(config=project / "nope.yaml"))
    with pytest.raises(UsageError, match="JOBID or JOBID:RUN_FOLDER"):
        launcher.status("tiny")


def test_missing_sbatch_is_a_usage_error(project: Path) -> None:
    launcher = SlurmLauncher(options=SlurmOptions(sbatch="/nonexistent/sbatch"))
    with pytest.raises(UsageError, match="'/nonexistent/sbatch' not found"):
        launcher.submit(LaunchRequest(config=project / "run.yaml", run_dir=project / "runs"))


# -- against the test cluster -----------------------------------------------------------------


@pytest.mark.slow
def test_a_bad_partition_is_a_one_line_usage_error(project: Path, slurm_env: object) -> None:
    launcher = SlurmLauncher(options=SlurmOptions(partition="nope"))
    with pytest.raises(UsageError) as caught:
        launcher.submit(LaunchRequest(config=project / "run.yaml", run_dir=project / "runs"))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("sbatch refused the job (launch.options.partition='nope'): ")
    assert "Invalid partition" in message


@pytest.mark.slow
def test_a_two_process_gloo_job_trains_to_success(project: Path, launcher: TidySlurm) -> None:
    request = LaunchRequest(
        config=project / "run.yaml",
        nproc_per_node=2,
        overrides=("training.max_steps=3",),
        run_dir=project / "runs",
    )
    handle = launcher.submit(request)
    job_id, folder = handle.split(":", 1)
    assert folder == str(project / "runs" / "tiny")
    assert (Path(folder) / "slurm.sbatch").read_text() in launcher.dry_run(request)
    seen = {launcher.status(handle)}
    assert seen <= {"PENDING", "RUNNING", "SUCCEEDED"}

    def ended() -> bool:
        seen.add(launcher.status(handle))
        return not seen.isdisjoint({"SUCCEEDED", "FAILED", "CANCELLED"})

    wait_for(ended, 120, "the job's end")
    text = launcher.logs(handle)
    assert launcher.status(handle) == "SUCCEEDED", text
    assert seen & {"PENDING", "RUNNING"}, seen  # it was followed before it ended
    assert launcher.status(job_id) == "SUCCEEDED"  # a bare job id works too
    assert launcher.logs(job_id) == text
    assert f"ups: job {job_id} on localhost, rendezvous at localhost:" in text
    done = events(text, "done")
    assert len(done) == 1 and done[0]["steps"] == 3, text
    assert (project / "runs" / "tiny" / "checkpoints" / "step-3" / "COMMIT").is_file(), text
    launcher.cancel(handle)  # an ended job is left as it is
    assert launcher.status(handle) == "SUCCEEDED"


@pytest.mark.slow
def test_cancel_ends_a_running_job_and_its_processes(project: Path, launcher: TidySlurm) -> None:
    request = LaunchRequest(
        config=project / "run.yaml",
        nproc_per_node=2,
        overrides=("training.epochs=100000", "run.name=long"),
        run_dir=project / "runs",
    )
    handle = launcher.submit(request)
    wait_for(lambda: '"event": "step"' in launcher.logs(handle), 180, "the job's first steps")
    assert launcher.status(handle) == "RUNNING"
    assert processes_mentioning(str(project / "run.yaml"))
    launcher.cancel(handle)
    assert launcher.status(handle) == "CANCELLED"
    wait_for(lambda: not processes_mentioning(str(project / "run.yaml")), 30, "the ranks' end")


@pytest.mark.slow
def test_a_preemption_notice_saves_a_checkpoint_and_requeues(
    project: Path, slurm_env: slurm_cluster.Cluster
) -> None:
    launcher = TidySlurm(options=SlurmOptions(signal_seconds=60, requeue=True, cancel_timeout_s=30))
    request = LaunchRequest(
        config=project / "run.yaml",
        nproc_per_node=2,
        overrides=("training.epochs=100000", "run.name=notice"),
        run_dir=project / "runs",
    )
    handle = launcher.submit(request)
    job_id = handle.split(":")[0]
    try:
        wait_for(lambda: '"event": "step"' in launcher.logs(handle), 180, "the job's first steps")
        # What SLURM does signal_seconds before the time limit (--signal=B:USR1@...):
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)
        wait_for(lambda: "requeueing job" in launcher.logs(handle), 180, "the requeue")
        text = launcher.logs(handle)
        assert "ups: pre-emption notice (SIGUSR1): the ranks save and stop" in text
        saved = events(text, "checkpoint saved")
        assert len(saved) == 1 and (Path(str(saved[0]["location"])) / "COMMIT").is_file(), text
        # The requeued job (same id, same output file) resumes from that checkpoint once SLURM
        # lets it start again: after the test cluster's cred_expire (10 s), while the killed
        # run's job credential stays revoked.
        wait_for(lambda: launcher.status(handle) == "PENDING", 30, "the job's requeue")
        # A fresh start of 2 ranks: a minute or more on a loaded 2-core machine.
        try:
            wait_for(lambda: '"resumed"' in launcher.logs(handle), 240, "the requeued resume")
        except AssertionError as error:
            job = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True)
            raise AssertionError(
                f"{error}\n{job.stdout.decode()}\n{slurm_env.daemon_log()}"
            ) from None
        resumed = events(launcher.logs(handle), "resumed")
        assert resumed[0]["step"] == saved[0]["step"]
        assert launcher.status(handle) == "RUNNING"
        launcher.cancel(handle)
        assert launcher.status(handle) == "CANCELLED"
    finally:
        launcher.cancel(handle)


@pytest.mark.slow
def test_without_requeue_a_preemption_notice_saves_and_fails_the_job(
    project: Path, launcher: TidySlurm
) -> None:
    launcher.options = SlurmOptions(signal_seconds=60)
    request = LaunchRequest(
        config=project / "run.yaml",
        nproc_per_node=2,
        overrides=("training.epochs=100000", "run.name=stop"),
        run_dir=project / "runs",
    )
    handle = launcher.submit(request)
    wait_for(lambda: '"event": "step"' in launcher.logs(handle), 180, "the job's first steps")
    subprocess.run(["scancel", "--batch", "--signal=USR1", handle.split(":")[0]], check=True)
    wait_for(lambda: launcher.status(handle) not in ("PENDING", "RUNNING"), 180, "the job's end")
    text = launcher.logs(handle)
    assert launcher.status(handle) == "FAILED", text
    assert "ups: stopped by the pre-emption notice" in text
    saved = events(text, "checkpoint saved")
    assert len(saved) == 1 and (Path(str(saved[0]["location"])) / "COMMIT").is_file(), text
    assert not processes_mentioning(str(project / "run.yaml"))


@pytest.mark.slow
def test_a_job_that_exits_non_zero_fails(project: Path, launcher: TidySlurm) -> None:
    launcher.options = SlurmOptions(python="/bin/false")
    handle = launcher.submit(LaunchRequest(config=project / "run.yaml", run_dir=project / "runs"))
    wait_for(lambda: launcher.status(handle) not in ("PENDING", "RUNNING"), 180, "the job's end")
    assert launcher.status(handle) == "FAILED", launcher.logs(handle)
    assert "srun: error: localhost: task 0: Exited with exit code 1" in launcher.logs(handle)
