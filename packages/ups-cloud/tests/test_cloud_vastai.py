"""The ``vastai`` launcher, through the real ``vastai`` client, against a loopback server
(tests/vast_server.py) that answers the endpoints the client calls."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from vast_server import VastServer

from ups.cloud import VastAIError, VastAILauncher, VastAILauncherOptions
from ups.cloud._startup import EXIT_FILE, LOG_FILE
from ups.cloud._vastai import MULTI_MACHINE_WARNING
from ups.core import LaunchRequest, UsageError
from ups.core.testing import tiny_project

KEY = "planted-vast-key-5f3a9c1e"


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[VastServer]:
    tiny_project(tmp_path / "configs", distributed={"backend": "gloo", "timeout_s": 60})
    (tmp_path / "configs" / "run.yaml").rename(tmp_path / "configs" / "tiny.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VAST_API_KEY", KEY)
    with VastServer(KEY) as srv:
        yield srv


def launcher(server: VastServer, **options: Any) -> VastAILauncher:
    defaults: dict[str, Any] = {"url": server.url, "poll_s": 0.02, "ready_timeout_s": 5.0}
    return VastAILauncher(options=VastAILauncherOptions(**{**defaults, **options}))


def request(nnodes: int = 1, nproc: int = 2) -> LaunchRequest:
    return LaunchRequest(config=Path("configs/tiny.yaml"), nproc_per_node=nproc, nnodes=nnodes)


def creates(server: VastServer) -> list[dict[str, Any]]:
    return [json.loads(body) for method, path, _h, body in server.requests if method == "PUT"
            and path.startswith("/api/v0/asks/")]  # fmt: skip


def test_dry_run_searches_but_creates_nothing_and_estimates_cost(server: VastServer) -> None:
    text = launcher(server, gpu_name="RTX_4090").dry_run(request())
    assert '"gpu_name": {"eq": "RTX 4090"}' in text
    assert '"reliability": {"gte": 0.95}' in text
    assert "# node 0: offer #102 2x RTX 4090" in text  # the cheapest reliable one
    assert "estimated cost: $0.7000/hour for 1 machine(s)" in text
    assert "PUT /api/v0/asks/102/" in text
    assert "torch.distributed.run" in text and "--standalone" in text
    assert 'vastai stop instance "$CONTAINER_ID"' in text
    assert server.instances == {} and creates(server) == []
    assert KEY not in text


def test_dry_run_without_a_key_shows_the_requests(
    server: VastServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VAST_API_KEY")
    text = launcher(server).dry_run(request())
    assert "offers not searched: vastai: no API key in $VAST_API_KEY" in text
    assert "PUT /api/v0/asks/OFFER_ID/" in text
    assert server.requests == []


def test_submit_status_logs_cancel(server: VastServer, capsys: pytest.CaptureFixture[str]) -> None:
    vast = launcher(server, gpu_name="RTX 4090", min_gpu_ram_gb=20)
    handle = vast.submit(request())
    assert handle == "vastai:9001"
    (body,) = creates(server)
    assert body["image"].startswith("pytorch/") and body["label"] == "ups"
    assert "--nproc-per-node" in body["onstart"] and body["disk"] == 40.0
    assert server.instances[9001]["machine_id"] == 102
    assert vast.status(handle) == "RUNNING"
    server.logs[9001] = "[ups-startup] training\nstep 1 loss 0.5\n"
    assert "step 1 loss 0.5" in vast.logs(handle)
    server.instances[9001].update(label="ups-exit-0", actual_status="exited")
    assert vast.status(handle) == "SUCCEEDED"
    server.instances[9001].update(label="ups-exit-1")
    assert vast.status(handle) == "FAILED"
    vast.cancel(handle)
    assert server.live() == [] and server.destroyed == [9001]
    assert vast.status(handle) == "CANCELLED"
    vast.cancel(handle)  # already gone: nothing to do
    # The key went only into the Authorization header of the API requests.
    for _method, path, headers, raw in server.requests:
        assert KEY not in path and KEY.encode() not in raw
        if not path.startswith("/logs/"):
            assert headers["Authorization"] == f"Bearer {KEY}"
        else:
            assert "Authorization" not in headers
    out = capsys.readouterr()
    assert KEY not in out.out + out.err + handle


def test_several_machines_rendezvous_on_the_first(
    server: VastServer, capsys: pytest.CaptureFixture[str]
) -> None:
    vast = launcher(
        server, gpu_name="RTX 4090", num_gpus=2, upload_url="s3://bucket/run",
        network_interface="eth1",
    )  # fmt: skip
    text = vast.dry_run(request(nnodes=2))
    assert "estimated cost: $1.5000/hour for 2 machine(s)" in text
    # Only the rendezvous port is mapped: the dry run and the submit say what else it needs.
    assert f"# warning: {MULTI_MACHINE_WARNING}\n" in text

    def warned() -> int:
        logged = capsys.readouterr()
        return (logged.out + logged.err).count("must reach each other directly on every port")

    assert warned() == 1
    handle = vast.submit(request(nnodes=2))
    assert warned() == 1
    assert handle == "vastai:9001,9002"
    first, second = creates(server)
    assert first["env"] == {"-p 29500:29500": "1"}
    assert "--rdzv-endpoint localhost:29500" in first["onstart"]
    assert "--node-rank 0" in first["onstart"] and "--nnodes 2" in first["onstart"]
    host = server.instances[9001]["public_ipaddr"].strip()
    port = server.instances[9001]["ports"]["29500/tcp"][0]["HostPort"]
    assert f"--rdzv-endpoint {host}:{port}" in second["onstart"]
    assert "--node-rank 1" in second["onstart"]
    # each machine forms the process group on the interface named
    assert "  ups_network 0 localhost eth1\n" in first["onstart"]
    assert f"  ups_network 1 {host} eth1\n" in second["onstart"]
    # each machine uploads its run folder to a place of its own
    assert 'upload "$UPS_RUN_DIR" s3://bucket/run ||' in first["onstart"]
    assert 'upload "$UPS_RUN_DIR" s3://bucket/run/nodes/1 ||' in second["onstart"]
    assert vast.status(handle) == "RUNNING"
    server.logs[9002] = "node one says hi\n"
    assert "==> instance 9002 (node 1) <==\nnode one says hi" in vast.logs(handle)
    vast.cancel(handle)
    assert server.live() == []
    # One machine needs no other: no warning.
    vast.cancel(vast.submit(request(nnodes=1)))
    assert "warning" not in vast.dry_run(request(nnodes=1)) and warned() == 0


def test_a_failed_create_tears_down_what_was_created(server: VastServer) -> None:
    server.faults["error"] = {r"PUT /api/v0/asks/101/": 500}
    vast = launcher(server, gpu_name="RTX 4090", num_gpus=2)
    with pytest.raises(VastAIError) as caught:
        vast.submit(request(nnodes=2))
    message = str(caught.value)
    assert "create an instance from offer 101: the server answered HTTP 500" in message
    assert "destroyed instance(s) 9001" in message and "\n" not in message
    assert server.live() == [] and server.destroyed == [9001]


def test_an_instance_that_never_runs_is_destroyed(server: VastServer) -> None:
    server.faults["never_ready"] = True
    vast = launcher(server, ready_timeout_s=0.2)
    with pytest.raises(VastAIError, match=r"instance 9001 was not running after 0.2s .*'loading'"):
        vast.submit(request())
    assert server.live() == [] and server.destroyed == [9001]


def test_unknown_gpu_name_suggests_the_nearest(server: VastServer) -> None:
    with pytest.raises(UsageError, match=r"unknown GPU name 'RTX 4099'; did you mean 'RTX 4090'"):
        launcher(server, gpu_name="RTX 4099").submit(request())
    assert server.instances == {}


def test_no_matching_offer_shows_the_nearest(server: VastServer) -> None:
    with pytest.raises(UsageError) as caught:
        launcher(server, gpu_name="RTX 4090", max_dph=0.5).submit(request())
    message = str(caught.value)
    assert "0 offer(s) match num_gpus=2 gpu_name=RTX 4090" in message
    # Each of the nearest misses one condition: the GPU count, or the price.
    assert "nearest: #103 1x RTX 4090 25 GB, reliability 0.995, $0.3500/h; #102 2x" in message
    assert server.instances == {}


def test_a_wrong_key_is_a_clear_usage_error(
    server: VastServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VAST_API_KEY", "wrong-key")
    with pytest.raises(
        UsageError, match=r"search offers: the server refused the API key \(HTTP 401\)"
    ):
        launcher(server).submit(request())
    assert server.instances == {}


def searches(server: VastServer) -> int:
    return sum(1 for method, _p, _h, _b in server.requests if method == "POST")


@pytest.mark.parametrize(
    ("retry_after", "waited"),
    [
        ("1", 1.0 + 1.0 + 1.0),  # as the server says, after each 429
        (None, 0.15 + 0.225 + 0.15),  # the client's own: 0.15 s, then 1.5 times longer
    ],
)
def test_rate_limits_are_retried_with_backoff(
    server: VastServer, retry_after: str | None, waited: float
) -> None:
    server.faults["retry_after"] = retry_after
    server.faults["rate_limit"] = {r"POST /api/v0/bundles/": 2, r"PUT /api/v0/asks/": 1}
    start = time.monotonic()
    handle = launcher(server).submit(request())
    assert time.monotonic() - start >= waited * 0.95
    assert handle == "vastai:9001"
    assert searches(server) == 3 and len(creates(server)) == 2  # each 429 tried again
    assert server.faults["rate_limit"] == {r"POST /api/v0/bundles/": 0, r"PUT /api/v0/asks/": 0}
    server.faults["rate_limit"] = {r"POST /api/v0/bundles/": 100}
    with pytest.raises(VastAIError, match=r"rate limited \(HTTP 429\) after retrying"):
        launcher(server, retries=2).submit(request())
    assert searches(server) == 3 + 2  # retries counts the attempts


def test_a_long_retry_after_is_not_waited_out(server: VastServer) -> None:
    server.faults.update(retry_after="120", rate_limit={r"POST /api/v0/bundles/": 1})
    with pytest.raises(VastAIError) as caught:
        launcher(server).submit(request())
    assert str(caught.value) == (
        "vastai: search offers: rate limited (HTTP 429); the server asks to wait 120 s "
        "(Retry-After), so the client did not retry: try again then"
    )
    assert searches(server) == 1  # not tried again


def test_server_errors_are_one_line(server: VastServer) -> None:
    server.faults["error"] = {r"/bundles/": 500}
    vast = launcher(server, retries=3)
    with pytest.raises(VastAIError, match=r"^vastai: search offers: the server answered HTTP 500$"):
        vast.submit(request())
    server.faults["error"] = {}
    handle = vast.submit(request())
    server.faults["error"] = {r"/instances/": 503}  # retried by the client, then given up
    with pytest.raises(VastAIError, match=r"^vastai: show instance 9001: .*HTTP 503$"):
        vast.status(handle)
    with pytest.raises(VastAIError, match=r"^vastai: could not destroy instance\(s\) 9001$"):
        vast.cancel(handle)
    server.faults["error"] = {}
    vast.cancel(handle)
    assert server.live() == []


def test_the_key_comes_from_a_named_file(
    server: VastServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("VAST_API_KEY")
    with pytest.raises(UsageError, match=r"no API key in \$VAST_API_KEY"):
        launcher(server).submit(request())
    key_file = tmp_path / "vast.key"
    key_file.write_text(KEY + "\n")
    assert launcher(server, api_key_file=str(key_file)).submit(request()) == "vastai:9001"
    with pytest.raises(UsageError, match="cannot read api_key_file"):
        launcher(server, api_key_file=str(tmp_path / "missing")).submit(request())


def test_a_key_in_the_script_is_refused(server: VastServer) -> None:
    vast = launcher(server, data_step=f"curl -H 'token: {KEY}' http://example.invalid")
    with pytest.raises(UsageError, match="would contain the API key"):
        vast.dry_run(request())
    with pytest.raises(UsageError, match="would contain the API key"):
        vast.submit(request())
    assert server.instances == {}


def test_a_bad_handle_is_a_usage_error(server: VastServer) -> None:
    with pytest.raises(UsageError, match="not a handle of this launcher"):
        launcher(server).status("slurm:12")


def onstart(server: VastServer) -> str:
    """The on-start script of the last instance created, as the server got it."""
    return str(creates(server)[-1]["onstart"])


def test_the_script_carries_the_config_and_the_listed_files(server: VastServer) -> None:
    config, model = (Path("configs", name).read_text() for name in ("tiny.yaml", "tiny.py"))
    launcher(server, files=["configs/tiny.py"]).submit(request())
    script = onstart(server)
    # Written on the machine at their paths here, so the config's tiny.py:build_model (relative
    # to the config) names the model file there too.
    assert f"printf '%s' {shlex.quote(config)} > configs/tiny.yaml" in script
    assert f"printf '%s' {shlex.quote(model)} > configs/tiny.py" in script
    assert "-m ups.core train configs/tiny.yaml" in script
    # The local absolute run folder means nothing there: the machine's is under its workdir.
    assert "-o run.output_dir=/root/ups/runs" in script
    # A config named by its absolute path here goes to its path relative to this folder.
    absolute = attrs.evolve(request(), config=Path.cwd() / "configs" / "tiny.yaml")
    launcher(server, files=["configs/tiny.py"]).submit(absolute)
    assert onstart(server) == script


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (["configs/nope.py"], "files: cannot read configs/nope.py: No such file or directory"),
        (["../tiny.py"], "files: '../tiny.py' must be a path relative to the working directory"),
        (["/etc/hostname"], "files: '/etc/hostname' must be a path relative to the working"),
    ],
)
def test_a_file_that_cannot_be_sent_is_a_usage_error(
    server: VastServer, files: list[str], message: str
) -> None:
    vast = launcher(server, files=files)
    for action in (vast.dry_run, vast.submit):
        with pytest.raises(UsageError, match=re.escape(message)):
            action(request())
    assert server.instances == {}


@pytest.mark.parametrize("action", ["stop", "destroy"])
def test_the_machine_trains_the_config_and_stops_itself_with_the_real_cli(
    server: VastServer, tmp_path: Path, action: str
) -> None:
    """The on-start script the server got, run as the machine would (in a folder here for
    ``/root/ups``; ``$CONTAINER_ID`` and ``$CONTAINER_API_KEY`` set by VastAI), stopping its
    instance with the real ``vastai`` CLI. Without the model file in ``files`` training fails."""
    files = ["configs/tiny.py"] if action == "stop" else []
    vast = launcher(server, shutdown_action=action, files=files)
    handle = vast.submit(request())
    machine = tmp_path / "machine"
    script = onstart(server).replace("/root/ups", str(machine))
    env = {k: v for k, v in os.environ.items() if k != "VAST_API_KEY"}
    env.update(
        CONTAINER_ID="9001",
        CONTAINER_API_KEY=KEY,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
    )
    assert KEY not in script and "--api-key" not in script
    done = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert KEY not in done.stdout + done.stderr
    runs = machine / "runs"
    log = (runs / LOG_FILE).read_text()
    status = (runs / EXIT_FILE).read_text().strip()
    labels = [
        json.loads(b)["label"] for m, _p, _h, b in server.requests if m == "PUT" and b"label" in b
    ]
    assert labels[-1] == f"ups-exit-{status}"
    if action == "stop":
        assert done.returncode == 0 and status == "0", log[-3000:]
        assert sorted((runs / "tiny" / "checkpoints").glob("step-*/COMMIT")), "no checkpoint"
        assert (machine / "configs" / "tiny.yaml").read_text() == Path(
            "configs/tiny.yaml"
        ).read_text()
        assert server.instances[9001]["label"] == "ups-exit-0"
        assert vast.status(handle) == "SUCCEEDED"
    else:
        assert done.returncode != 0 and status != "0"
        assert f"no such file: {machine}/configs/tiny.py" in log  # the config's model file
        assert server.live() == [] and server.destroyed == [9001]
        assert vast.status(handle) == "CANCELLED"
