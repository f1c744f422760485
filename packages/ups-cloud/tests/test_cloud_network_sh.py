"""``network.sh``, the bash a multi-machine start-up script finds its address with, shipped in
the package: clean under ``shellcheck`` (as the scripts that include it are, but for the
command lines they print on purpose), and run here by bash from the package's own file, with
``ip`` and ``getent`` on its PATH answering as a Vultr machine in a VPC would. Run in whole
scripts, on real network namespaces: test_cloud_startup.py.

Without ``shellcheck`` the checks by it skip, unless ``UPS_REQUIRE_SERVICES`` is set (as in
CI, which installs it)."""

from __future__ import annotations

import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest

from ups.cloud._startup import NETWORK_SCRIPT, Env, StartupScript, network_functions
from ups.core import LaunchRequest

NETWORK_SH = resources.files("ups.cloud").joinpath(NETWORK_SCRIPT)

# `ip -4 -o addr show` of a machine with a public NIC (the default route), docker's bridge and
# a VPC NIC.
ADDRESSES = """\
2: eth0    inet 203.0.113.5/24 brd 203.0.113.255 scope global eth0\\       valid_lft forever
3: docker0    inet 172.17.0.1/16 brd 172.17.255.255 scope global docker0\\       valid_lft forever
4: enp8s0    inet 10.1.96.3/20 brd 10.1.111.255 scope global enp8s0\\       valid_lft forever
"""
FAKE_IP = r"""#!/usr/bin/env bash
# ip, as the machine of ADDRESSES answers; a route to $FAKE_ROUTE_TO only.
case "$*" in
  "-4 -o route get 127.0.0.1") echo "local 127.0.0.1 dev lo table local src 127.0.0.1 uid 0" ;;
  "-4 -o route get $FAKE_ROUTE_TO") echo "$FAKE_ROUTE_TO dev enp8s0 src 10.1.96.3 uid 0" ;;
  "-4 -o route get "*) echo "RTNETLINK answers: Network is unreachable" >&2; exit 2 ;;
  "-4 -o route show default") echo "default via 203.0.113.1 dev eth0 proto static" ;;
  "-4 -o addr show scope global" | "-4 -o addr show") printf '%s' "$FAKE_ADDRESSES" ;;
  "-4 -o addr show dev "*" scope global") printf '%s' "$FAKE_ADDRESSES" | grep " $6 " ;;
  *) echo "fake ip: unexpected: $*" >&2; exit 1 ;;
esac
"""
FAKE_GETENT = r"""#!/usr/bin/env bash
# getent ahostsv4: an address is itself, localhost is 127.0.0.1, other names are unknown.
case "$2" in
  localhost) echo "127.0.0.1       STREAM localhost" ;;
  *[!0-9.]*) exit 2 ;;
  *) echo "$2       STREAM $2" ;;
esac
"""
CALL = """set -euo pipefail
ups_say() { printf '%s\\n' "$*"; }
source "$NETWORK_SH"
ups_network "$@"
echo "found $UPS_IS_HOST $UPS_LOCAL_ADDR $UPS_IFACE $GLOO_SOCKET_IFNAME $NCCL_SOCKET_IFNAME"
"""


def shellcheck() -> str:
    found = shutil.which("shellcheck")
    if found is None:
        if os.environ.get("UPS_REQUIRE_SERVICES"):
            pytest.fail("UPS_REQUIRE_SERVICES is set but shellcheck is not installed")
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    return found


def test_network_sh_is_clean_under_shellcheck() -> None:
    with resources.as_file(NETWORK_SH) as path:
        result = subprocess.run([shellcheck(), str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("nnodes", [1, 2])
def test_a_rendered_script_has_no_shellcheck_warning(nnodes: int, tmp_path: Path) -> None:
    """Style notes aside: the script prints its commands in single quotes, unexpanded."""
    script = StartupScript(
        request=LaunchRequest(config=Path("c.yaml"), nnodes=nnodes, nproc_per_node=2),
        files={"c.yaml": "run: {name: x}\n", "model.py": "X = '$(y)'\n"},
        packages={"fsspec": "2024.12.0"},
        data_step="echo data",
        nproc_per_node="gpu",
        node_rank=Env("NODE_RANK") if nnodes > 1 else 0,
        rdzv_host="10.1.96.4" if nnodes > 1 else None,
        upload_url="s3://bucket/run",
        auto_shutdown=True,
        env_names=("STORAGE_KEY",),
    ).render()
    assert (network_functions() in script) == (nnodes > 1)
    path = tmp_path / "startup.sh"
    path.write_text(script)
    result = subprocess.run(
        [shellcheck(), "--severity=warning", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, text in (("ip", FAKE_IP), ("getent", FAKE_GETENT)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def network(bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``ups_network ARGS`` from the package's network.sh, run by bash in its own folder."""
    with resources.as_file(NETWORK_SH) as path:
        env = {
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "NETWORK_SH": str(path),
            "FAKE_ADDRESSES": ADDRESSES,
            "FAKE_ROUTE_TO": "10.1.96.4",
            "NCCL_SOCKET_IFNAME": "=mine",
        }
        return subprocess.run(
            ["bash", "-c", CALL, "bash", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=bin_dir.parent,
            timeout=60,
        )


@pytest.mark.parametrize(
    ("args", "found"),
    [
        # The first machine: the VPC's NIC beside the public one (docker's is never chosen).
        (("0", "127.0.0.1", ""), "1 10.1.96.3 enp8s0"),
        (("0", "localhost", ""), "1 10.1.96.3 enp8s0"),
        # Another machine: the NIC and address of its route to the first.
        (("1", "10.1.96.4", ""), "0 10.1.96.3 enp8s0"),
        # A named NIC wins.
        (("1", "10.1.96.4", "eth0"), "0 203.0.113.5 eth0"),
        (("0", "127.0.0.1", "docker0"), "1 172.17.0.1 docker0"),
    ],
)
def test_each_machine_finds_its_address_and_tells_gloo_and_nccl(
    bin_dir: Path, args: tuple[str, str, str], found: str
) -> None:
    result = network(bin_dir, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    nic = found.split()[-1]
    assert result.stdout.splitlines()[-1] == f"found {found} {nic} =mine"
    assert f"network: machine {args[0]} is {' '.join(found.split()[1:2])} on {nic}" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("1", "10.9.9.9", ""), "cannot reach the rendezvous host 10.9.9.9: RTNETLINK answers"),
        (("1", "10.1.96.4", "ens7"), "no IPv4 address on ens7 for the other machines to reach"),
    ],
)
def test_no_address_for_the_other_machines_is_said_and_fails(
    bin_dir: Path, args: tuple[str, str, str], message: str
) -> None:
    result = network(bin_dir, *args)
    assert result.returncode == 1 and message in result.stdout, result.stdout + result.stderr
    assert "found" not in result.stdout
