"""The ``vultr`` launcher against a loopback Vultr API v2 (``vultr_server``): requests, several
machines, faults (401, 429, 5xx, an instance never ready, a failed create) and the API key."""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vultr_server import KEY, VultrServer, serve

from ups.cloud import VultrError, VultrLauncher, VultrLauncherOptions
from ups.core import LaunchRequest, UsageError
from ups.core.testing import tiny_project

GPU = "vcg-a100-1c-6g-4vram"


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[VultrServer]:
    tiny_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VULTR_API_KEY", KEY)
    with serve() as srv:
        yield srv


def launcher(server: VultrServer, **options: Any) -> VultrLauncher:
    settings: dict[str, Any] = {
        "plan": GPU,
        "region": "ewr",
        "base_url": server.url,
        "poll_s": 0.01,
        "ready_timeout_s": 5,
        "backoff_s": 0,
        "files": ("tiny.py",),
        "packages": {"ups-cloud": "0.1.0"},
        **options,
    }
    return VultrLauncher(options=VultrLauncherOptions(**settings))


def request(nnodes: int = 1) -> LaunchRequest:
    return LaunchRequest(config=Path("run.yaml"), nnodes=nnodes, nproc_per_node=2)


def posts(server: VultrServer) -> list[dict[str, Any]]:
    return [r for r in server.requests if r["method"] == "POST"]


def user_data(post: dict[str, Any]) -> str:
    return base64.b64decode(post["body"]["user_data"]).decode()


def test_dry_run_shows_every_request_and_the_cost_and_creates_nothing(
    server: VultrServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VULTR_API_KEY")  # the lists a dry-run reads need no key
    text = launcher(server).dry_run(request(nnodes=2))
    assert text.count(f"POST {server.url}/instances") == 2
    assert f"GET {server.url}/plans" in text
    assert "Authorization: Bearer <redacted> (from $VULTR_API_KEY)" in text
    assert '"enable_vpc": true' in text
    assert '"plan": "vcg-a100-1c-6g-4vram"' in text
    # The user data, decoded: both machines' scripts, the second with its rank.
    assert text.count("#!/usr/bin/env bash") == 2
    assert "--nnodes 2 --node-rank 1" in text
    assert "internal_ip of machine 0" in text
    # 90/month over 672 hours, for 2 machines.
    assert "about $0.268/hour for 2 machine(s)" in text
    assert posts(server) == []
    assert all(r["method"] == "GET" for r in server.requests)
    # A NIC named in the options is the one each machine forms the process group on.
    named = launcher(server, network_interface="enp8s0").dry_run(request(nnodes=2))
    assert "  ups_network 0 127.0.0.1 enp8s0\n" in named
    assert "  ups_network 1 '<internal_ip of machine 0>' enp8s0\n" in named


def test_two_machines_rendezvous_on_the_first_ones_private_address(
    server: VultrServer, tmp_path: Path
) -> None:
    upload = tmp_path / "uploaded"
    vultr = launcher(server, upload_url=upload.as_uri())
    handle = vultr.submit(request(nnodes=2))
    created = posts(server)
    assert len(created) == 2
    ids = handle.removeprefix("vultr:").split(",")
    assert ids == list(server.instances)
    first_ip = server.instances[ids[0]]["internal_ip"]
    assert re.fullmatch(r"10\.7\.96\.\d+", first_ip)
    first, second = (user_data(p) for p in created)
    assert "--nnodes 2 --node-rank 0" in first and "--node-rank 1" in second
    assert "--rdzv-endpoint 127.0.0.1:29500" in first  # it serves the rendezvous
    assert f"--rdzv-endpoint {first_ip}:29500" in second
    # Each finds its own VPC address at start (the first: beside the public NIC; the second:
    # the route to the first) for the process group, not its hostname.
    assert "  ups_network 0 127.0.0.1 ''\n" in first
    assert f"  ups_network 1 {first_ip} ''\n" in second
    assert '--local-addr "$UPS_LOCAL_ADDR"' in first and '--local-addr "$UPS_LOCAL_ADDR"' in second
    assert "ups-cloud==0.1.0" in first and "build_model" in first  # pins, files
    assert f"{upload.as_uri()}/nodes/1" in second  # each machine uploads to its own place
    assert all(p["body"]["enable_vpc"] is True for p in created)
    assert [p["body"]["label"] for p in created] == ["ups-tiny-0", "ups-tiny-1"]
    assert vultr.status(handle) == "RUNNING"
    assert "ssh root@IP" in vultr.logs(handle)

    # The scripts end: the run folders are uploaded, the machines shut themselves down.
    upload.mkdir()
    (upload / "startup.log").write_text("training done\n")
    (upload / "startup.exit").write_text("0\n")
    server.stop_all()
    # Machine 1 stopped without its upload (each uploads before it stops): the machines, which
    # hold what was not copied, are kept and billed, and the job says so.
    assert vultr.status(handle) == "STOPPED"
    assert list(server.instances) == ids and server.deleted == []
    assert vultr.logs(handle) == "training done\n"
    # Every machine has uploaded: status deletes them, since stopped instances bill.
    (upload / "nodes" / "1").mkdir(parents=True)
    (upload / "nodes" / "1" / "startup.exit").write_text("0\n")
    assert vultr.status(handle) == "SUCCEEDED"
    assert server.instances == {} and server.deleted == ids
    assert vultr.status(handle) == "SUCCEEDED"  # from the upload, once they are gone
    (upload / "startup.exit").write_text("1\n")
    assert vultr.status(handle) == "FAILED"

    vultr.cancel(handle)  # gone already: nothing to do
    assert server.deleted == ids
    (upload / "startup.exit").unlink()
    assert vultr.status(handle) == "CANCELLED"


def test_one_machine_is_pending_until_booted_and_stopped_without_an_upload(
    server: VultrServer,
) -> None:
    vultr = launcher(server)
    handle = vultr.submit(request())
    body = posts(server)[0]["body"]
    assert "enable_vpc" not in body and body["os_id"] == 1743
    assert "--standalone" in user_data(posts(server)[0])
    (instance,) = server.instances.values()
    instance["server_status"] = "installingbooting"
    assert vultr.status(handle) == "PENDING"
    server.stop_all()
    assert vultr.status(handle) == "STOPPED"  # no upload_url: the outcome is unknown
    assert len(server.instances) == 1  # kept (and billed) for the results on its disk
    vultr.cancel(handle)
    assert server.instances == {}


@pytest.mark.parametrize("from_file", [False, True])
def test_the_api_key_is_sent_only_as_the_bearer_header(
    server: VultrServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    from_file: bool,
) -> None:
    options: dict[str, Any] = {"upload_url": (tmp_path / "up").as_uri()}
    if from_file:
        monkeypatch.delenv("VULTR_API_KEY")
        (tmp_path / "key").write_text(KEY + "\n")
        options["api_key_file"] = str(tmp_path / "key")
    vultr = launcher(server, **options)
    outputs = [vultr.dry_run(request(nnodes=2))]
    handle = vultr.submit(request(nnodes=2))
    outputs += [handle, vultr.status(handle), vultr.logs(handle)]
    vultr.cancel(handle)
    outputs += [user_data(p) for p in posts(server)]
    outputs += [str(r["body"]) + str(r["query"]) for r in server.requests]
    captured = capsys.readouterr()
    outputs += [captured.out, captured.err, caplog.text]
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "key"]
    outputs += [p.read_text(errors="replace") for p in files]
    assert not [o for o in outputs if KEY in o]
    authorizations = {r["headers"].get("Authorization") for r in server.requests}
    assert authorizations == {None, f"Bearer {KEY}"}  # lists unauthenticated, the rest with it


def test_a_missing_key_fails_before_anything_is_created(
    server: VultrServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VULTR_API_KEY")
    with pytest.raises(UsageError, match=r"no API key in \$VULTR_API_KEY"):
        launcher(server).submit(request())
    assert server.requests == []


def test_a_refused_key_is_a_one_line_usage_error(
    server: VultrServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VULTR_API_KEY", "wrong")
    with pytest.raises(UsageError, match="401 Unauthorized: the API key from") as info:
        launcher(server).submit(request())
    assert "\n" not in str(info.value)
    assert server.instances == {}


def test_429_is_retried_after_retry_after_and_500_with_backoff(server: VultrServer) -> None:
    server.faults += [
        *[("GET", "/plans", 500, {})] * 3,
        ("POST", "/instances", 429, {"Retry-After": "1"}),
        ("GET", "/instances/", 503, {}),
    ]
    start = time.monotonic()
    vultr = launcher(server, backoff_s=0.25)
    handle = vultr.submit(request())
    # The 500s: 0 s, then 2 x 0.25 s, then 4 x 0.25 s (urllib3's backoff); the 429: as told.
    assert time.monotonic() - start >= (0 + 0.5 + 1.0 + 1.0) * 0.95
    plans = [r for r in server.requests if r["path"] == "/plans"]
    assert len(plans) == 3 + 2  # each 500 tried again, then the list's 2 pages
    assert len(posts(server)) == 2 and len(server.instances) == 1  # one 429, one create
    assert server.faults == []
    vultr.cancel(handle)


def test_a_create_is_not_retried_after_500(server: VultrServer) -> None:
    server.fail_create_at = 1
    with pytest.raises(VultrError, match=r"creating machine 1 of 1 failed: .*500") as info:
        launcher(server).submit(request())
    assert "\n" not in str(info.value)
    assert len(posts(server)) == 1 and server.instances == {}


def test_5xx_after_every_retry_is_a_one_line_error(server: VultrServer) -> None:
    server.faults += [("GET", "/plans", 502, {})] * 3
    with pytest.raises(VultrError, match=r"GET /plans: 502 Bad Gateway after 2 retries"):
        launcher(server, retries=2).dry_run(request())


def test_a_failed_second_create_deletes_the_first(server: VultrServer) -> None:
    server.fail_create_at = 2
    with pytest.raises(VultrError) as info:
        launcher(server).submit(request(nnodes=2))
    message = str(info.value)
    assert message.startswith("creating machine 2 of 2 failed")
    (first,) = server.deleted
    assert f"deleted the 1 instance(s) created: {first}" in message
    assert server.instances == {}


def test_an_instance_never_ready_is_deleted(server: VultrServer) -> None:
    server.ready_after = None
    with pytest.raises(VultrError, match=r"not ready within 0.2 s \(status pending") as info:
        launcher(server, ready_timeout_s=0.2).submit(request(nnodes=2))
    assert "deleted the 1 instance(s) created" in str(info.value)
    assert server.instances == {} and len(server.deleted) == 1


@pytest.mark.parametrize(
    ("plan", "region", "message"),
    [
        ("vcg-a100-1c-6g-4vr", "ewr", "unknown plan 'vcg-a100-1c-6g-4vr'; nearest: vcg-a100-1c"),
        ("h100", "ewr", "GPU plans in ewr: vcg-a100-12c-120g-80vram, vcg-a100-1c-6g-4vram"),
        (GPU, "ewx", "unknown region 'ewx'; nearest: ewr"),
        (
            GPU,
            "ams",
            "plan 'vcg-a100-1c-6g-4vram' is not offered in region 'ams'; it is in: ewr, ord",
        ),
    ],
)
def test_unknown_plans_and_regions_name_the_nearest(
    server: VultrServer, plan: str, region: str, message: str
) -> None:
    vultr = launcher(server, plan=plan, region=region)
    for action in (vultr.dry_run, vultr.submit):
        with pytest.raises(UsageError, match=re.escape(message)):
            action(request())
    assert posts(server) == []


def test_bad_handles_and_options(server: VultrServer) -> None:
    vultr = launcher(server)
    for handle in ("local:x", "vultr:", "vultr:a,,b", "vultr:../x"):
        with pytest.raises(UsageError, match="not a vultr handle"):
            vultr.status(handle)
    with pytest.raises(ValueError, match="give os_id or image_id, not both"):
        launcher(server, os_id=1743, image_id="x")
