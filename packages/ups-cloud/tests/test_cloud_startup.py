"""The start-up script of the cloud launchers: its text, and scripts really run by bash.

A script run here finds first on its PATH a ``shutdown`` that records its arguments (the real
one never runs), and either a stand-in ``python`` that records how it was called (quick) or
this Python, training the tiny project on 2 CPU processes (slow).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from ups.cloud._startup import (
    EXIT_FILE,
    LOG_FILE,
    Env,
    StartupScript,
    main,
    node_upload_url,
    upload,
)
from ups.cloud._vultr import FIRST_MACHINE_RDZV_HOST
from ups.core import LaunchRequest, UsageError
from ups.core.testing import free_port, tiny_project, two_machines

HOSTILE = "a b; rm -rf / $(touch pwned) `touch pwned` 'q' \"dq\""
SECRET_NAME = "UPS_TEST_API_KEY"
SECRET = "sk-planted-0123456789abcdef"

# A stand-in for python: records its argv (one JSON list a line) and the network interfaces
# gloo and NCCL are told (in FAKE_RECORD.env), and exits with $FAKE_STATUS.
FAKE_PYTHON = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["FAKE_RECORD"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
with open(os.environ["FAKE_RECORD"] + ".env", "a") as f:
    f.write(json.dumps({k: v for k, v in os.environ.items() if k.endswith("_SOCKET_IFNAME")}))
sys.exit(int(os.environ.get("FAKE_STATUS", "0")))
"""


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A folder with a ``shutdown`` that appends its arguments to ``shutdown.calls``."""
    folder = tmp_path / "bin"
    folder.mkdir()
    executable(folder / "shutdown", f'#!/bin/sh\necho "$*" >> {tmp_path}/shutdown.calls\n')
    return folder


def run_script(
    script: str,
    tmp_path: Path,
    bin_dir: Path,
    env: Mapping[str, str] = {},
    timeout: float = 120,
    prefix: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with bash in ``tmp_path`` (``prefix``: the command that runs bash, e.g.
    ``ip netns exec NAME``), ``bin_dir`` first on its PATH."""
    path = tmp_path / "startup.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], check=False).returncode == 0
    environ = {k: v for k, v in os.environ.items() if k != SECRET_NAME}
    environ |= {"PATH": f"{bin_dir}:{os.environ['PATH']}", **env}
    return subprocess.run(
        [*prefix, "bash", str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environ,
        cwd=tmp_path,
        check=False,
    )


def shutdown_calls(tmp_path: Path) -> list[str]:
    calls = tmp_path / "shutdown.calls"
    return calls.read_text().splitlines() if calls.exists() else []


def recorded(tmp_path: Path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp_path / "record").read_text().splitlines()]


def quick(tmp_path: Path, bin_dir: Path, **fields: Any) -> StartupScript:
    """A script run by the stand-in python, in a work folder whose name is hostile."""
    python = executable(bin_dir / "fake-python", FAKE_PYTHON)
    defaults: dict[str, Any] = {
        "request": LaunchRequest(config=Path("run.yaml"), nproc_per_node=2),
        "workdir": str(tmp_path / "work dir; $(touch pwned)"),
        "python": str(python),
        "auto_shutdown": True,
    }
    return StartupScript(**(defaults | fields))


# -- the text -----------------------------------------------------------------------------------


def test_every_value_is_quoted() -> None:
    script = StartupScript(
        request=LaunchRequest(config=Path(HOSTILE), overrides=(f"run.name={HOSTILE}",)),
        workdir="/w/" + HOSTILE,
        files={HOSTILE: HOSTILE},
        data_step=HOSTILE,
        upload_url="s3://bucket/" + HOSTILE,
        auto_shutdown=True,
        shutdown_command=HOSTILE,
    ).render()
    for value in (HOSTILE, f"run.name={HOSTILE}", "/w/" + HOSTILE, "s3://bucket/" + HOSTILE):
        assert shlex.quote(value) in script
    # No line runs the value as code: each of its occurrences is inside one quoted word.
    assert script.count("rm -rf") == script.count(shlex.quote(HOSTILE)[1:12])
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0


def test_one_machine_runs_standalone_torchrun() -> None:
    script = StartupScript(
        request=LaunchRequest(config=Path("c.yaml"), nproc_per_node=4, overrides=("a=1",)),
        packages={"ups-dist-core": "0.1.0", "torch": "2.4.1+cu121"},
    ).render()
    assert script.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script
    assert "pip install --no-input --disable-pip-version-check" in script
    assert "ups-dist-core==0.1.0 torch==2.4.1+cu121" in script
    assert "NPROC=4\n" in script
    assert (
        'python3 -m torch.distributed.run --nproc-per-node "$NPROC" --standalone '
        "-m ups.core train c.yaml -o a=1 -o run.output_dir=/root/ups/runs" in script
    )
    assert "shutdown" not in script and "ups.cloud._startup upload" not in script
    assert "ups_network" not in script and "--local-addr" not in script  # one machine: no search


def test_several_machines_rendezvous_on_the_first() -> None:
    script = StartupScript(
        request=LaunchRequest(config=Path("c.yaml"), nnodes=3),
        node_rank=Env("NODE_RANK"),
        rdzv_host="10.0.0.2",
        rdzv_port=29400,
        rdzv_id="job-1",
        max_restarts=3,
    ).render()
    assert (
        'torch.distributed.run --max-restarts 3 --nproc-per-node "$NPROC" '
        '--nnodes 3 --node-rank "${NODE_RANK:?NODE_RANK is not set}" --rdzv-backend c10d '
        "--rdzv-endpoint 10.0.0.2:29400 --rdzv-id job-1" in script
    )
    assert "--standalone" not in script
    # The agents' rendezvous store is fresh each round, so restarted ranks can connect.
    assert "\nexport TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" in script


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"packages": {"bad name": "1.0"}}, "not a distribution name"),
        ({"packages": {"torch": ">=2"}}, "not an exact version"),
        ({"packages": {"torch": "1.0; rm -rf /"}}, "not an exact version"),
        ({"files": {"../x": ""}}, "relative path inside workdir"),
        ({"files": {"/etc/x": ""}}, "relative path inside workdir"),
        ({"workdir": "relative"}, "absolute path"),
        ({"env_names": ("A-B",)}, "not an environment variable name"),
        ({"nproc_per_node": 0}, "nproc_per_node"),
        ({"nproc_per_node": "cpu"}, "nproc_per_node"),
        ({"request": LaunchRequest(config=Path("c"), nnodes=2)}, "rdzv_host"),
        ({"request": LaunchRequest(config=Path("c"), nproc_per_node=0)}, "nproc_per_node"),
        ({"node_rank": 1}, "node_rank 1"),
        ({"network_interface": "eth0; reboot"}, "network_interface: 'eth0; reboot'"),
    ],
)
def test_bad_fields_are_usage_errors(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        StartupScript(**({"request": LaunchRequest(config=Path("c"))} | fields))


def test_env_rejects_a_bad_name() -> None:
    with pytest.raises(UsageError, match="environment variable name"):
        Env("$(x)")


def test_a_secret_is_named_never_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_NAME, SECRET)
    spec = StartupScript(
        request=LaunchRequest(config=Path("c.yaml")),
        upload_url="s3://bucket/run",
        env_names=(SECRET_NAME,),
    )
    script = spec.render()
    assert SECRET not in script
    assert f"${{{SECRET_NAME}:?" in script
    for leaky in (
        {"data_step": f"curl -H 'key: {SECRET}' x"},
        {"upload_url": f"https://u:{SECRET}@host/x"},
        {"files": {"c.yaml": f"key: {SECRET}\n"}},
    ):
        with pytest.raises(UsageError, match=f"value of \\${SECRET_NAME}") as error:
            StartupScript(**(attrs_fields(spec) | leaky)).render()
        assert SECRET not in str(error.value)


def attrs_fields(spec: StartupScript) -> dict[str, Any]:
    import attrs

    return attrs.asdict(spec, recurse=False)


# -- scripts run by bash, with a stand-in python --------------------------------------------------


def test_a_script_runs_its_steps_in_order(tmp_path: Path, bin_dir: Path) -> None:
    spec = quick(
        tmp_path,
        bin_dir,
        request=LaunchRequest(config=Path("conf/run.yaml"), overrides=(f"run.name={HOSTILE}",)),
        files={"conf/run.yaml": f"name: {HOSTILE}\n", "tiny.py": "x = 1"},
        packages={"ups-cloud": "0.1.0"},
        data_step='echo "$PWD" > data.marker',
        nproc_per_node=3,
        upload_url="file:///nowhere",
    )
    result = run_script(spec.render(), tmp_path, bin_dir, {"FAKE_RECORD": str(tmp_path / "record")})
    assert result.returncode == 0, result.stdout + result.stderr
    work = Path(spec.workdir)
    assert (work / "conf/run.yaml").read_text() == f"name: {HOSTILE}\n"
    assert (work / "tiny.py").read_text() == "x = 1"
    assert (work / "data.marker").read_text() == f"{work}\n"
    assert not (tmp_path / "pwned").exists() and not (work / "pwned").exists()
    install, train, up = recorded(tmp_path)
    assert install[-1] == "ups-cloud==0.1.0"
    assert train == [
        "-m", "torch.distributed.run", "--nproc-per-node", "3", "--standalone",
        "-m", "ups.core", "train", "conf/run.yaml",
        "-o", f"run.name={HOSTILE}", "-o", f"run.output_dir={work}/runs",
    ]  # fmt: skip
    assert up == ["-m", "ups.cloud._startup", "upload", f"{work}/runs", "file:///nowhere"]
    assert shutdown_calls(tmp_path) == ["-h now"]
    log = (work / "runs" / LOG_FILE).read_text()
    assert "running the data step" in log and "torch.distributed.run" in log
    assert "steps ended with exit status 0" in log and "shutting the machine down" in log
    assert log in result.stdout or result.stdout.strip() in log
    assert (work / "runs" / EXIT_FILE).read_text() == "0\n"


def test_a_failing_step_still_uploads_and_shuts_down(tmp_path: Path, bin_dir: Path) -> None:
    spec = quick(tmp_path, bin_dir, upload_url="file:///x", data_step="echo fetching; exit 7")
    result = run_script(spec.render(), tmp_path, bin_dir, {"FAKE_RECORD": str(tmp_path / "record")})
    assert result.returncode == 7
    assert [call[:3] for call in recorded(tmp_path)] == [["-m", "ups.cloud._startup", "upload"]]
    assert shutdown_calls(tmp_path) == ["-h now"]
    log = (Path(spec.workdir) / "runs" / LOG_FILE).read_text()
    assert "fetching" in log and "exit status 7" in log


def test_training_status_is_the_scripts(tmp_path: Path, bin_dir: Path) -> None:
    spec = quick(tmp_path, bin_dir, upload_url="file:///x")
    env = {"FAKE_RECORD": str(tmp_path / "record"), "FAKE_STATUS": "3"}
    result = run_script(spec.render(), tmp_path, bin_dir, env)
    # Training (the stand-in) exits 3; the upload, by the same stand-in, fails too, and is logged.
    assert result.returncode == 3
    assert "the upload failed" in result.stdout
    assert shutdown_calls(tmp_path) == ["-h now"]


def test_a_missing_secret_stops_the_script(tmp_path: Path, bin_dir: Path) -> None:
    spec = quick(tmp_path, bin_dir, env_names=(SECRET_NAME,), packages={"torch": "2.4.1"})
    result = run_script(spec.render(), tmp_path, bin_dir, {"FAKE_RECORD": str(tmp_path / "record")})
    assert result.returncode != 0
    assert f"{SECRET_NAME} must be set in the environment" in result.stdout
    assert not (tmp_path / "record").exists()  # nothing installed, nothing trained
    assert shutdown_calls(tmp_path) == ["-h now"]


def test_a_secret_reaches_the_steps_from_the_environment(tmp_path: Path, bin_dir: Path) -> None:
    spec = quick(
        tmp_path, bin_dir, env_names=(SECRET_NAME,), data_step=f'echo "${SECRET_NAME}" > seen'
    )
    script = spec.render()
    assert SECRET not in script
    env = {"FAKE_RECORD": str(tmp_path / "record"), SECRET_NAME: SECRET}
    assert run_script(script, tmp_path, bin_dir, env).returncode == 0
    assert (Path(spec.workdir) / "seen").read_text() == f"{SECRET}\n"


def test_several_machines_take_rank_and_host_from_the_environment(
    tmp_path: Path, bin_dir: Path
) -> None:
    spec = quick(
        tmp_path,
        bin_dir,
        request=LaunchRequest(config=Path("c.yaml"), nnodes=2, nproc_per_node=1),
        node_rank=Env("NODE_RANK"),
        rdzv_host=Env("FIRST_HOST"),
        auto_shutdown=False,
    )
    env = {"FAKE_RECORD": str(tmp_path / "record"), "NODE_RANK": "1", "FIRST_HOST": "10.1.2.3"}
    assert run_script(spec.render(), tmp_path, bin_dir, env).returncode == 0
    (train,) = recorded(tmp_path)
    assert train[:13] == [
        "-m", "torch.distributed.run", "--nproc-per-node", "1", "--nnodes", "2",
        "--node-rank", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.1.2.3:29500",
        "--rdzv-id",
    ]  # fmt: skip
    assert shutdown_calls(tmp_path) == []
    # Without the variables, the script stops, naming the one missing.
    os.remove(tmp_path / "record")
    result = run_script(spec.render(), tmp_path, bin_dir, {"FAKE_RECORD": str(tmp_path / "rec")})
    assert result.returncode != 0 and "NODE_RANK is not set" in result.stdout


VPC = {"eth0": "203.0.113.5/24", "docker0": "172.17.0.1/16", "enp8s0": "10.1.96.3/20"}
"""A Vultr machine in a VPC: the public NIC carries the default route (via 203.0.113.1)."""


@contextmanager
def machine_with(nics: Mapping[str, str]) -> Iterator[str]:
    """A network namespace with ``nics`` (name -> address/prefix; veths whose peers stay in
    it), the first carrying the default route (via its .1); yields its name."""
    name = f"ups-nics-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for i, (nic, address) in enumerate(nics.items()):
            for command in (
                ["link", "add", nic, "type", "veth", "peer", "name", f"peer{i}"],
                ["addr", "add", address, "dev", nic],
                ["link", "set", nic, "up"],
                ["link", "set", f"peer{i}", "up"],
            ):
                subprocess.run(["ip", "-n", name, *command], check=True)
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        gateway = next(iter(nics.values())).rsplit(".", 1)[0] + ".1"
        subprocess.run(["ip", "-n", name, "route", "add", "default", "via", gateway], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


@pytest.mark.parametrize(
    ("nics", "rdzv_host", "interface", "found"),
    [
        # The first machine (the rendezvous on 127.0.0.1, vastai's localhost): the VPC's NIC.
        (VPC, "127.0.0.1", None, ("1", "10.1.96.3", "enp8s0")),
        (VPC, "localhost", None, ("1", "10.1.96.3", "enp8s0")),
        # Another machine: the NIC and source address of its route to the first one.
        (VPC, "10.1.96.4", None, ("0", "10.1.96.3", "enp8s0")),
        (VPC, "198.51.100.7", None, ("0", "203.0.113.5", "eth0")),
        # The first machine named by its own address.
        (VPC, "10.1.96.3", None, ("1", "10.1.96.3", "enp8s0")),
        # A named interface always wins.
        (VPC, "127.0.0.1", "eth0", ("1", "203.0.113.5", "eth0")),
        (VPC, "10.1.96.4", "docker0", ("0", "172.17.0.1", "docker0")),
        # One NIC, public or private (a container's): that one.
        ({"eth0": "203.0.113.5/24"}, "127.0.0.1", None, ("1", "203.0.113.5", "eth0")),
        ({"eth0": "172.17.0.2/16", "docker0": "172.18.0.1/16"}, "localhost", None,
         ("1", "172.17.0.2", "eth0")),
    ],
)  # fmt: skip
def test_each_machine_finds_its_address_on_the_job_network(
    tmp_path: Path,
    bin_dir: Path,
    nics: dict[str, str],
    rdzv_host: str,
    interface: str | None,
    found: tuple[str, str, str],
) -> None:
    is_host, address, nic = found
    spec = quick(
        tmp_path,
        bin_dir,
        request=LaunchRequest(config=Path("c.yaml"), nnodes=2, nproc_per_node=1),
        node_rank=Env("NODE_RANK"),
        rdzv_host=rdzv_host,
        network_interface=interface,
    )
    record = tmp_path / "record"
    env = {"FAKE_RECORD": str(record), "NODE_RANK": "0", "NCCL_SOCKET_IFNAME": "=mine"}
    with machine_with(nics) as namespace:
        result = run_script(
            spec.render(), tmp_path, bin_dir, env, prefix=("ip", "netns", "exec", namespace)
        )
    assert result.returncode == 0, result.stdout
    (train,) = recorded(tmp_path)
    assert train[14:18] == ["--rdzv-conf", f"is_host={is_host}", "--local-addr", address]
    # gloo is told the interface; NCCL keeps the one the environment sets.
    gloo = {"GLOO_SOCKET_IFNAME": nic, "NCCL_SOCKET_IFNAME": "=mine"}
    assert json.loads(record.with_suffix(".env").read_text()) == gloo
    assert f"network: machine 0 is {address} on {nic}" in result.stdout


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"network_interface": "ens7"}, "no IPv4 address on ens7 for the other machines to "
         "reach; set network_interface"),
        ({"rdzv_host": "no-such-host.invalid"}, "cannot reach the rendezvous host no-such-host"),
    ],
)  # fmt: skip
def test_no_address_for_the_other_machines_stops_the_script(
    tmp_path: Path, bin_dir: Path, fields: dict[str, Any], message: str
) -> None:
    request = LaunchRequest(config=Path("c.yaml"), nnodes=2)
    spec = quick(tmp_path, bin_dir, request=request, node_rank=1, rdzv_host="10.1.96.4")
    env = {"FAKE_RECORD": str(tmp_path / "record")}
    script = StartupScript(**(attrs_fields(spec) | fields)).render()
    with machine_with(VPC) as namespace:
        result = run_script(
            script, tmp_path, bin_dir, env, prefix=("ip", "netns", "exec", namespace)
        )
    assert result.returncode == 1
    assert message in result.stdout
    assert not (tmp_path / "record").exists()  # training never started


@pytest.mark.parametrize(("gpus", "nproc"), [(0, "1"), (2, "2")])
def test_gpu_means_one_process_per_gpu(
    tmp_path: Path, bin_dir: Path, gpus: int, nproc: str
) -> None:
    if gpus:
        listing = "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(gpus))
        executable(bin_dir / "nvidia-smi", "#!/bin/sh\n" + listing)
    elif shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    spec = quick(tmp_path, bin_dir, nproc_per_node="gpu")
    result = run_script(spec.render(), tmp_path, bin_dir, {"FAKE_RECORD": str(tmp_path / "record")})
    assert result.returncode == 0, result.stdout
    (train,) = recorded(tmp_path)
    assert train[2:4] == ["--nproc-per-node", nproc]


# -- upload -------------------------------------------------------------------------------------


def test_upload_copies_a_folder_to_a_url(tmp_path: Path) -> None:
    src = tmp_path / "runs"
    (src / "tiny" / "ckpt").mkdir(parents=True)
    (src / "startup.log").write_text("log")
    (src / "tiny" / "ckpt" / "s1.pt").write_bytes(b"\0\1")
    (src / "startup.exit").write_text("0\n")
    (src / "tiny" / "zz.txt").write_text("z")
    written = upload(src, (tmp_path / "dest").as_uri())
    assert len(written) == 4
    # The exit status goes last: once it is there, so is everything else.
    assert written[-1] == f"{tmp_path / 'dest'}/startup.exit"
    assert (tmp_path / "dest" / "startup.log").read_text() == "log"
    assert (tmp_path / "dest" / "tiny" / "ckpt" / "s1.pt").read_bytes() == b"\0\1"
    assert main(["upload", str(src), str(tmp_path / "plain")]) == 0
    assert (tmp_path / "plain" / "tiny" / "ckpt" / "s1.pt").exists()
    assert main(["download", "x"]) == 2


# -- a real run -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_script_trains_uploads_and_shuts_down(tmp_path: Path, bin_dir: Path) -> None:
    """The tiny project, shipped in the script, trains on 2 CPU processes; then a broken config."""
    source = tmp_path / "source"
    tiny_project(source, distributed={"backend": "gloo", "timeout_s": 60})
    files = {name: (source / name).read_text() for name in ("run.yaml", "tiny.py")}
    spec = StartupScript(
        request=LaunchRequest(config=Path("run.yaml"), nproc_per_node=2),
        workdir=str(tmp_path / "machine"),
        files=files,
        python=sys.executable,
        data_step="echo data > data.marker",
        upload_url=(tmp_path / "bucket").as_uri(),
        auto_shutdown=True,
    )
    result = run_script(spec.render(), tmp_path, bin_dir)
    assert result.returncode == 0, result.stdout[-3000:]
    runs = tmp_path / "machine" / "runs"
    assert (tmp_path / "machine" / "data.marker").read_text() == "data\n"
    checkpoints = sorted((runs / "tiny" / "checkpoints").glob("step-*/COMMIT"))
    assert checkpoints, "training saved no checkpoint"
    bucket = tmp_path / "bucket"
    uploaded = sorted(p.relative_to(bucket) for p in bucket.rglob("*") if p.is_file())
    assert Path(LOG_FILE) in uploaded and Path(EXIT_FILE) in uploaded
    assert checkpoints[-1].relative_to(runs) in uploaded
    assert shutdown_calls(tmp_path) == ["-h now"]
    log = (runs / LOG_FILE).read_text()
    assert "exit status 0" in log and "uploaded" in log

    broken = StartupScript(
        **(
            attrs_fields(spec)
            | {
                "request": LaunchRequest(
                    config=Path("run.yaml"), nproc_per_node=2, overrides=("training.no_such_key=1",)
                )
            }
        )
    )
    shutil.rmtree(bucket)
    result = run_script(broken.render(), tmp_path, bin_dir)
    assert result.returncode != 0
    assert (runs / EXIT_FILE).read_text() == f"{result.returncode}\n"
    assert (bucket / LOG_FILE).exists() and "no_such_key" in (bucket / LOG_FILE).read_text()
    assert shutdown_calls(tmp_path) == ["-h now", "-h now"]


@pytest.mark.slow
def test_two_machines_train_over_the_private_network(tmp_path: Path, bin_dir: Path) -> None:
    """A 2-machine job's two scripts, as vultr renders them, each run in a network namespace
    under a hostname of its own that resolves to nothing: they find the address and interface
    the other machine reaches them on, form their process group over it and train to the end."""
    source = tmp_path / "source"
    tiny_project(source, distributed={"backend": "gloo", "timeout_s": 30})
    files = {name: (source / name).read_text() for name in ("run.yaml", "tiny.py")}
    tag, bucket = f"s{os.getpid() % 10000}", tmp_path / "bucket"
    request = LaunchRequest(config=Path("run.yaml"), nproc_per_node=1, nnodes=2)

    def machine(rank: int, namespace: str) -> subprocess.CompletedProcess[str]:
        spec = StartupScript(
            request=request,
            workdir=str(tmp_path / "machine"),  # each machine's own disk, mounted there
            files=files,
            python=sys.executable,
            node_rank=rank,
            rdzv_host=FIRST_MACHINE_RDZV_HOST if rank == 0 else "10.77.0.1",
            rdzv_port=port,
            rdzv_id=f"ups-{tag}",
            upload_url=node_upload_url(bucket.as_uri(), rank),
            auto_shutdown=True,
        )
        disk = tmp_path / f"m{rank}"
        (disk / "machine").mkdir(parents=True)
        # A label for a hostname, as a cloud VM has, that nothing resolves (no DNS in here).
        boot = f'hostname "$0" && ! getent hosts "$0" && mount --bind {disk}/machine "$1"'
        boot += ' && shift && exec "$@"'
        prefix = ("ip", "netns", "exec", namespace, "unshare", "--uts", "--mount", "sh", "-c")
        prefix += (boot, f"ups-{tag}-machine-{rank}", spec.workdir)
        env = {"OMP_NUM_THREADS": "1"}
        return run_script(spec.render(), tmp_path / f"m{rank}", bin_dir, env, 90, prefix)

    port = free_port()
    (tmp_path / "machine").mkdir()
    with two_machines(tag) as namespaces, ThreadPoolExecutor(2) as pool:
        first, second = pool.map(machine, (0, 1), namespaces)
    for result in (first, second):
        assert result.returncode == 0, result.stdout[-4000:]
    runs = [tmp_path / f"m{rank}" / "machine" / "runs" for rank in (0, 1)]
    assert [(run / EXIT_FILE).read_text() for run in runs] == ["0\n", "0\n"]
    for rank, (run, end) in enumerate(zip(runs, "ab", strict=True)):
        found = (
            f"machine {rank} is 10.77.0.{rank + 1} on v{tag}{end} (GLOO_SOCKET_IFNAME=v{tag}{end},"
        )
        assert f"network: {found}" in (run / LOG_FILE).read_text()
    # Global rank 0 (on either machine) saved the checkpoints: of a world of 2, to the end.
    checkpoints = [p for run in runs for p in (run / "tiny" / "checkpoints").glob("step-*")]
    assert [p.name for p in checkpoints] == ["step-4"]  # 64 samples, 8 a batch, 2 ranks
    state = torch.load(checkpoints[0] / "state.pt", weights_only=True)
    assert (state["world_size"], state["step"]) == (2, 4)
    assert (bucket / EXIT_FILE).read_text() == "0\n"
    assert (bucket / "nodes" / "1" / EXIT_FILE).read_text() == "0\n"
    assert shutdown_calls(tmp_path) == ["-h now", "-h now"]
