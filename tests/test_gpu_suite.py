"""The GPU suite (tests/gpu, ``nox -s gpu``) on a machine without CUDA: every test is collected
and skipped for "no CUDA device", and the run says so. The ``integration`` session leaves
tests/gpu out and runs this instead, so CI never skips it silently nor runs it twice."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = {
    "test_gpu_compile",
    "test_gpu_examples",
    "test_gpu_fsdp",
    "test_gpu_guard",
    "test_gpu_loader",
    "test_gpu_nccl",
    "test_gpu_oom",
    "test_gpu_tune_profile",
}


def test_the_gpu_suite_collects_and_skips_every_test_for_no_cuda_device(tmp_path: Path) -> None:
    report = tmp_path / "gpu.xml"
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml")),
            *("-m", "gpu", "-rs", "-p", "no:cacheprovider", f"--junitxml={report}"),
            str(ROOT / "tests" / "gpu"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=os.environ | {"CUDA_VISIBLE_DEVICES": ""},  # no CUDA device, whatever the machine
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    cases = list(ET.parse(report).getroot().iter("testcase"))
    assert {case.get("classname", "").split(".")[-1] for case in cases} == MODULES
    skipped = [case.find("skipped") for case in cases]
    assert all(s is not None and s.get("message") == "no CUDA device" for s in skipped)
    # -rs lists the skips with their reason: the session's output says why nothing ran.
    assert f"{len(cases)} skipped" in result.stdout
    assert "SKIPPED" in result.stdout and ": no CUDA device" in result.stdout
