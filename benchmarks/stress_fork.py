"""How often a forked loader worker hangs: many evaluations with fresh workers, on 2 ranks.

Python before 3.11.8 can deadlock a child in ``os.fork()`` when another thread of the parent
creates or ends a thread state at that moment (CPython gh-112275): the new worker never runs,
and its rank waits for a batch that never comes. This runs ``ups train --nproc 2`` of the tiny
project of ``ups.core.testing`` again and again for ``--minutes``, each run ``--steps`` steps with
an evaluation after every step, the training loader's 2 workers fresh at every epoch
(``persistent_workers: false``), the evaluation's forked once a run (the engine keeps them
since issue 26; before, they were forked at every evaluation): ranks with the engine's
threads (the step watchdog, gloo's) forking workers many times a run. A hung worker stops its
run: the step watchdog names the rank after ``distributed.timeout_s`` (``--timeout``), or the
run passes ``--run-timeout``. Every run's leftover processes (a hung fork outlives its rank)
are killed before the next.

Prints and writes (``--out``, default ``.nox-reports/stress_fork.json``) the forks made (counted
from the runs' evaluations and epochs), the hangs, and hangs per 10,000 forks and per 10,000
evaluations (what a user's run meets, whatever the forks behind it). Not a test: it
takes minutes, and a rate needs thousands of forks; ``docs/benchmarks.md`` has the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _stats import ROOT, source_state

from ups.core.testing import tiny_project

SAMPLES, BATCH, RANKS, WORKERS = 64, 8, 2, 2
STEPS_PER_EPOCH = SAMPLES // (BATCH * RANKS)


def _leftovers(marker: str) -> list[int]:
    """The pids of processes whose command line holds ``marker`` (a run's folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_text():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return found


def one_run(folder: Path, steps: int, timeout_s: float, run_timeout_s: float) -> dict[str, object]:
    """Train the tiny project once; return its outcome, forks made and leftover processes."""
    config = tiny_project(
        folder,
        data={"loader": {"num_workers": WORKERS, "persistent_workers": False}},
        eval={"factory": "tiny.py:build_dataset", "options": {"n": 16}, "every_steps": 1},
        training={"epochs": math.ceil(steps / STEPS_PER_EPOCH), "max_steps": steps},
        run={"log_every": 1000},
        checkpoint={"every_steps": None},
        distributed={"timeout_s": timeout_s},
    )
    command = [sys.executable, "-m", "ups.core", "train", str(config), "--nproc", str(RANKS)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "UPS_LOG_FORMAT": "json"}
    start = time.monotonic()
    output = folder / "output.txt"  # not a pipe: a hung worker would hold it open
    with output.open("w") as out:
        try:
            done = subprocess.run(command, env=env, stdout=out, stderr=out, timeout=run_timeout_s)
            outcome = "ok" if done.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            outcome = "timeout"
    seconds = time.monotonic() - start
    lines = output.read_text().strip().splitlines()
    evaluated = _evaluations(folder / "runs" / "tiny" / "metrics.jsonl")
    left = _leftovers(str(folder))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    epochs = math.ceil(evaluated / STEPS_PER_EPOCH)
    return {
        "outcome": outcome,
        "hung": outcome != "ok",
        "forks": (min(evaluated, 1) + epochs) * WORKERS * RANKS,
        "evaluations": evaluated,
        "seconds": round(seconds, 1),
        "leftovers": len(left),
        "error": lines[-1][:300] if outcome != "ok" and lines else "",
    }


def _evaluations(metrics: Path) -> int:
    """The evaluations a run recorded (one ``"kind": "eval"`` record each)."""
    if not metrics.is_file():
        return 0
    return len(re.findall(r'"kind":\s*"eval"', metrics.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=15, help="how long to keep starting runs")
    parser.add_argument("--steps", type=int, default=200, help="steps (and evaluations) a run")
    parser.add_argument("--timeout", type=float, default=20, help="distributed.timeout_s")
    parser.add_argument("--run-timeout", type=float, default=600, help="seconds a run may take")
    parser.add_argument("--label", default="", help="what is measured, kept in the output")
    parser.add_argument("--out", type=Path, default=ROOT / ".nox-reports" / "stress_fork.json")
    options = parser.parse_args()
    runs: list[dict[str, object]] = []
    deadline = time.monotonic() + options.minutes * 60
    with tempfile.TemporaryDirectory() as tmp:
        while time.monotonic() < deadline:
            run = one_run(
                Path(tmp) / str(len(runs)), options.steps, options.timeout, options.run_timeout
            )
            runs.append(run)
            print(json.dumps(run), flush=True)
    forks = sum(int(str(run["forks"])) for run in runs)
    hangs = sum(bool(run["hung"]) for run in runs)
    result = {
        "label": options.label,
        "python": sys.version.split()[0],
        "source": source_state("packages"),
        "load_average": os.getloadavg(),
        "runs": len(runs),
        "forks": forks,
        "hangs": hangs,
        "hangs_per_10k_forks": round(hangs / forks * 10_000, 2) if forks else None,
        "evaluations": (evaluations := sum(int(str(run["evaluations"])) for run in runs)),
        "hangs_per_10k_evaluations": round(hangs / evaluations * 10_000, 2)
        if evaluations
        else None,
        "each": runs,
    }
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(result, indent=2))
    summary = {k: v for k, v in result.items() if k != "each"}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
