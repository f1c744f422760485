"""Run one command detached from whoever started it, and record how it ended.

``python -m ups.cloud._runner FOLDER CWD -- COMMAND...``: forks, prints the child's pid on
stdout and returns at once. The child leads a new session (so the job has a process group of its
own and survives its submitter), sends its output and the command's to ``FOLDER/launch.log``,
runs the command in ``CWD``, and writes ``FOLDER/exit.json`` (the exit status) when it ends.
Being a child of init, not of the submitter, it never lingers as a zombie of a live process.

Termination signals (``cancel``'s SIGTERM to the process group) reach the command too; the
runner itself outlives them, to record the exit status.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

LOG_FILE = "launch.log"
EXIT_FILE = "exit.json"


def main(argv: list[str]) -> None:
    folder, cwd, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: python -m ups.cloud._runner FOLDER CWD -- COMMAND...")
    pid = os.fork()
    if pid:
        print(pid, flush=True)
        os._exit(0)
    os.setsid()
    _redirect(Path(folder) / LOG_FILE)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _outlive)  # a handler, not SIG_IGN: exec resets it for the command
    try:
        child = subprocess.Popen(command, cwd=cwd)
    except OSError as error:
        print(f"ups-cloud: cannot start {command[0]!r}: {error}", file=sys.stderr, flush=True)
        returncode = 127
    else:
        returncode = child.wait()
    _record_exit(Path(folder), returncode)
    os._exit(0)


def _outlive(signum: int, _frame: object) -> None:
    print(f"ups-cloud: {signal.Signals(signum).name} received", file=sys.stderr, flush=True)


def _redirect(log: Path) -> None:
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)


def _record_exit(folder: Path, returncode: int) -> None:
    ended = datetime.now(timezone.utc).isoformat(timespec="seconds")
    tmp = folder / f".{EXIT_FILE}.{os.getpid()}"
    with open(tmp, "w") as file:
        json.dump({"returncode": returncode, "end_time": ended}, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, folder / EXIT_FILE)


if __name__ == "__main__":
    main(sys.argv[1:])
