"""How fast the ``ups`` command answers when it does not train (issue 18, item 8).

Each command runs as users run it (``python -m ups.core ...``, a fresh interpreter) in a
folder holding a launched-run record of the ``local`` launcher, beside ``python -c pass`` and
``python -c "import torch"`` in the same run. Targets: ``ups --help`` and ``ups status`` <=
0.35 s, ``ups plugins`` <= 0.6 s, with every distribution installed. Prints a Markdown table
of the medians (min, max) and whether each command imported torch, and writes
``.nox-reports/bench_cli.json``. Measure on a quiet machine; the load average is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _stats import ROOT, source_state, summary

COMMANDS: dict[str, list[str]] = {
    "python -c pass": ["-c", "pass"],
    "python -c 'import torch'": ["-c", "import torch"],
    "ups --help": ["-m", "ups.core", "--help"],
    "ups status RUN": ["-m", "ups.core", "status", "RUN"],
    "ups plugins": ["-m", "ups.core", "plugins"],
}
TARGETS = {"ups --help": 0.35, "ups status RUN": 0.35, "ups plugins": 0.6}
IMPORTS_TORCH = """
import runpy, sys
sys.argv = ["ups", *sys.argv[1:]]
try:
    runpy.run_module("ups.core", run_name="__main__")
except SystemExit:
    pass
print("torch" in sys.modules, file=sys.stderr)
"""
"""Runs ``ups ARGS`` as ``python -m ups.core`` does; prints whether torch was imported."""


def launched_run(folder: Path) -> Path:
    """A run record of the ``local`` launcher, for ``ups status``: a job that succeeded."""
    from ups.cloud import JobRecord
    from ups.core.launch._record import new_record
    from ups.core.plugin._records import LaunchRequest

    job = folder / "job"
    job.mkdir()
    command = ("python", "-m", "ups.core", "train", "run.yaml")
    log = str(job / "launch.log")
    record = JobRecord(
        name="run", pid=0, proc_start=None, command=command, cwd=str(folder), start_time="", log=log
    )
    (job / "job.json").write_text(record.to_json())
    (job / "exit.json").write_text('{"returncode": 0}')
    request = LaunchRequest(
        config=folder / "run.yaml", nproc_per_node=1, nnodes=1, overrides=(), run_dir=folder
    )
    return new_record("local", {}, str(job), request).write(folder / "runs" / "run")


def timed(args: list[str], cwd: Path) -> float:
    """Seconds ``python ARGS`` takes; it must succeed."""
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        record = launched_run(folder)
        rows = {}
        for name, args in COMMANDS.items():
            args = [str(record) if a == "RUN" else a for a in args]
            times = [timed(args, folder) for _ in range(options.repeats)]
            torch = None
            if args[:2] == ["-m", "ups.core"]:
                done = subprocess.run(
                    [sys.executable, "-c", IMPORTS_TORCH, *args[2:]],
                    cwd=folder,
                    capture_output=True,
                    text=True,
                )
                torch = done.stderr.strip().splitlines()[-1] == "True"
            rows[name] = {**summary(times), "imports_torch": torch, "target": TARGETS.get(name)}
    load = os.getloadavg()
    print(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {options.repeats} runs each")
    print("| command | median s | min s | max s | target s | imports torch |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        print(
            f"| `{name}` | {row['median']:.3f} | {row['min']:.3f} | {row['max']:.3f} | "
            f"{row['target'] or ''} | {'' if row['imports_torch'] is None else row['imports_torch']} |"
        )
    report = ROOT / ".nox-reports" / "bench_cli.json"
    report.parent.mkdir(exist_ok=True)
    report.write_text(
        json.dumps(
            {"rows": rows, "loadavg": load, "source": source_state("packages", "plugins")},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
