"""What ``ups.cloud`` names: every launcher and its options, imported when first used."""

from __future__ import annotations

import subprocess
import sys

import ups.cloud
from ups.core import JobState


def test_importing_ups_cloud_imports_no_launcher() -> None:
    code = "import sys, ups.cloud; print(sorted(m for m in sys.modules if 'ups.cloud' in m))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['ups.cloud']"


def test_every_name_it_lists_is_there() -> None:
    assert set(ups.cloud.__all__) <= set(dir(ups.cloud))
    for name in ups.cloud.__all__:
        assert getattr(ups.cloud, name).__name__ in (name, JobState.__name__), name
    for launcher in ("Local", "Slurm", "VastAI", "Vultr"):
        assert getattr(ups.cloud, f"{launcher}Launcher").__module__.startswith("ups.cloud._")
