"""How long ``ups.core.train(config, nproc=N)`` takes to start its ranks: forked from ups's
forkserver (the default) against spawned (``UPS_START_METHOD=spawn``), in the same run.

Each start method runs in a fresh interpreter that imports ``ups.core`` and times, ``--repeats``
times, ``train`` of the tiny project of ``ups.core.testing`` (64 samples, 4 steps, one
checkpoint) on ``--nproc`` ranks: the first call (which starts the forkserver) apart, and the
later ones (a notebook's or a sweep's second run, a restart). Prints a Markdown table of the
medians (min, max) and the ratio spawn / forkserver, and writes
``.nox-reports/bench_launch.json``. Measure on a quiet machine; the load average is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from _stats import ROOT, source_state, summary

METHODS = ("spawn", "forkserver")
TIMED = """
import json, sys, tempfile, time
from pathlib import Path
from ups.core import train
from ups.core.testing import tiny_project
nproc, repeats = int(sys.argv[1]), int(sys.argv[2])
times = []
with tempfile.TemporaryDirectory() as tmp:
    for i in range(repeats):
        project = tiny_project(Path(tmp) / str(i), training={"max_steps": 4})
        start = time.perf_counter()
        train(project, nproc=nproc)
        times.append(time.perf_counter() - start)
print(json.dumps(times))
"""
"""Times ``train`` of the tiny project ``repeats`` times on ``nproc`` ranks; prints the list."""


def timed(method: str, nproc: int, repeats: int) -> list[float]:
    """Seconds each of ``repeats`` trainings took with ``UPS_START_METHOD=method``."""
    env = {**os.environ, "UPS_START_METHOD": method, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", TIMED, str(nproc), str(repeats)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    times: list[float] = json.loads(done.stdout.strip().splitlines()[-1])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6, help="trainings per start method")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per training")
    options = parser.parse_args()
    rows = {}
    for method in METHODS:
        times = timed(method, options.nproc, options.repeats)
        rows[method] = {"first": times[0], "later": summary(times[1:])}
    ratio = rows["spawn"]["later"]["median"] / rows["forkserver"]["later"]["median"]
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {options.nproc} ranks")
    print("| start method | first train s | later trains: median s | min s | max s |")
    print("| --- | --- | --- | --- | --- |")
    for method, row in rows.items():
        later = row["later"]
        print(
            f"| {method} | {row['first']:.2f} | {later['median']:.2f} | {later['min']:.2f} | "
            f"{later['max']:.2f} |"
        )
    print(f"ratio spawn / forkserver, later trains: {ratio:.2f}")
    report = ROOT / ".nox-reports" / "bench_launch.json"
    report.parent.mkdir(exist_ok=True)
    report.write_text(
        json.dumps(
            {"rows": rows, "ratio": ratio, "loadavg": load, "source": source_state("packages")},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
