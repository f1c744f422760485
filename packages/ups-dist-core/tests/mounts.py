"""Commands that meet a read-only or a full filesystem for real: a tmpfs mounted in a mount
namespace of the command's own, as root (CI: ``unshare --mount``) or not (``unshare --user
--map-root-user``). Root writes in a folder that chmod made read-only, so only a mount holds
for both.

Register it from a test module with ``pytest_plugins = ["mounts"]``, then ask for
``tmpfs``. Where this machine allows no mount namespace, the tests that use it skip, unless
``UPS_REQUIRE_SERVICES`` is set (as in CI), where they fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

UNSHARE = (
    ("unshare", "--mount", "--propagation", "private")
    if os.geteuid() == 0
    else ("unshare", "--user", "--map-root-user", "--mount")
)
SCRIPT = """
folder=$1 options=$2 fill=$3 kept=$4
shift 4
mount -t tmpfs -o "$options" ups-test "$folder" || exit 97
[ "$fill" = 0 ] || cat /dev/zero > "$folder/.fill" 2>/dev/null
"$@"
status=$?
rm -f "$folder/.fill"
[ -z "$kept" ] || cp -a "$folder/." "$kept/"
exit $status
"""
"""Mount, fill, run, copy what the tmpfs holds out of the namespace, which takes it along."""


class Tmpfs:
    """Runs commands with a tmpfs mounted in a mount namespace of their own."""

    def run(
        self,
        folder: Path,
        *command: str,
        options: str,
        fill: bool = False,
        kept: Path | None = None,
        timeout: float = 180,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` (logging JSON) with a tmpfs mounted at ``folder`` (which must exist)
        with ``options`` (``ro``, ``size=600k``); ``fill``: filled up first. What the tmpfs
        holds when the command ends is copied into ``kept`` (made)."""
        if kept is not None:
            kept.mkdir(parents=True)
        script = ["sh", "-c", SCRIPT, "sh", str(folder), options, str(int(fill)), str(kept or "")]
        return subprocess.run(
            [*UNSHARE, *script, *command],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=os.environ | {"UPS_LOG_FORMAT": "json"},
            check=False,
        )

    def ups(self, folder: Path, *args: str, **how: Any) -> subprocess.CompletedProcess[str]:
        """:meth:`run` ``ups ARGS`` (``python -m ups.core ARGS``)."""
        return self.run(folder, sys.executable, "-m", "ups.core", *args, **how)


@pytest.fixture(scope="session")
def _mount_namespaces(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Fail or skip, once, where no tmpfs can be mounted in a namespace of its own."""
    folder = tmp_path_factory.mktemp("mount-check")
    try:
        probe = subprocess.run(
            [*UNSHARE, "mount", "-t", "tmpfs", "-o", "size=4k", "ups-test", str(folder)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        reason = None if probe.returncode == 0 else probe.stderr.strip()
    except FileNotFoundError:
        reason = "unshare is not installed (util-linux)"
    if reason is not None:
        message = f"no tmpfs in a mount namespace of its own: {' '.join(UNSHARE)}: {reason}"
        if os.environ.get("UPS_REQUIRE_SERVICES"):
            pytest.fail(f"UPS_REQUIRE_SERVICES is set but {message}")
        pytest.skip(message)


@pytest.fixture
def tmpfs(_mount_namespaces: None) -> Tmpfs:
    """A :class:`Tmpfs`, where this machine allows it."""
    return Tmpfs()
