"""What every benchmark here reports the same way: spreads over rounds, and the source measured.

``bench_samplers.py`` and ``bench_ckpt.py`` import it as a sibling module (``python
benchmarks/bench_*.py`` puts this folder first on ``sys.path``, in their workers too).
``bench_engine.py`` cannot: its ranks load it as a model file, without this folder on the path.
"""

from __future__ import annotations

import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def summary(values: list[float]) -> dict[str, float]:
    """The median, min and max of the rounds' values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def source_state(*sources: str) -> dict[str, str]:
    """The commit measured, and ``git status`` of the source folders (relative to the
    repository) the benchmark depends on: empty when they are as committed."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.rstrip()

    changed = git("status", "--porcelain", "--", *sources)
    return {"commit": git("rev-parse", "--short", "HEAD"), "changes": changed}
