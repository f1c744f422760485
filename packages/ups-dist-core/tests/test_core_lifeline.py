"""A launcher killed with SIGKILL takes its ranks, and their loader workers, with it; a rank
killed so takes its workers (:mod:`ups.core.launch._lifeline`). Real processes, found through /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ups.core.testing import tiny_project, wait_for

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal and /proc are Linux's"
)

TIMEOUT_S = 10.0
"""``distributed.timeout_s`` of the runs: every rank and worker must be gone within it."""
STARTED_S = 120.0
"""How long a launch may take to reach training, on a loaded machine."""

Proc = tuple[int, int]
"""A process: its pid and start time (so that a reused pid is not taken for it)."""


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, start time)`` of ``pid``, or ``None`` when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return fields[0], int(fields[1]), int(fields[19])


def _running(proc: Proc) -> bool:
    stat = _stat(proc[0])
    return stat is not None and stat[0] not in "ZX" and stat[2] == proc[1]


def _descendants(pid: int) -> set[Proc]:
    """Every running process below ``pid``."""
    stats = {int(p.name): _stat(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    found: set[Proc] = set()
    parents = {pid}
    while parents:
        children = {
            (p, s[2]) for p, s in stats.items() if s is not None and s[1] in parents and s[0] != "Z"
        }
        parents = {p for p, _ in children - found}
        found |= children
    return found


def _command(pid: int) -> str:
    """The start of ``pid``'s command line, for a message."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:100].decode()
    return f"pid {pid}"


def _kill_and_watch(launcher: subprocess.Popen[bytes], tree: set[Proc], seconds: float) -> None:
    """SIGKILL ``launcher`` alone; assert that every process of ``tree`` ends within
    ``seconds`` (and kill those left, so a failure leaves nothing behind)."""
    launcher.kill()
    launcher.wait()

    def left() -> list[Proc]:
        return [p for p in tree if _running(p)]

    try:
        wait_for(
            lambda: not left(),
            seconds,
            "its processes to end after SIGKILL of the one that started them",
            details=lambda: f"alive: {[_command(pid) for pid, _ in left()]}",
        )
    finally:
        for pid, _ in left():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _launched(command: list[str], config: Path) -> tuple[subprocess.Popen[bytes], set[Proc]]:
    """Start ``command`` (training ``config`` on 2 ranks of one loader worker each); return
    it and its processes once both ranks train."""
    pids = config.parent / "pids"
    launcher = subprocess.Popen(
        command,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def training() -> bool:  # both ranks built their model and forked their worker
            ranks = [int(p.name) for p in pids.iterdir()]
            return len(ranks) == 2 and all(_descendants(rank) for rank in ranks)

        wait_for(
            training, STARTED_S, "both ranks training, with their loader workers", process=launcher
        )
    except BaseException:
        launcher.kill()
        raise
    return launcher, _descendants(launcher.pid)


def _long_run(folder: Path) -> Path:
    """A config training for hours on 2 ranks, each with a persistent loader worker; each
    rank writes its pid into ``folder/pids``."""
    (folder / "pids").mkdir()
    return tiny_project(
        folder,
        model={"options": {"pid_dir": str(folder / "pids")}},
        data={"loader": {"num_workers": 1, "persistent_workers": True}},
        training={"epochs": 1_000_000},
        checkpoint={"every_steps": None},
        distributed={"nproc": 2, "timeout_s": TIMEOUT_S},
    )


@pytest.mark.slow
def test_ranks_and_workers_of_ups_train_end_with_their_launcher(tmp_path: Path) -> None:
    config = _long_run(tmp_path)
    command = [sys.executable, "-m", "ups.core", "train", str(config), "--nproc", "2"]
    launcher, tree = _launched(command, config)
    _kill_and_watch(launcher, tree, TIMEOUT_S)


@pytest.mark.slow
def test_ranks_of_ups_core_train_end_with_the_process_that_called_it(tmp_path: Path) -> None:
    config = _long_run(tmp_path)
    code = "import sys; from ups.core import train; train(sys.argv[1], nproc=2)"
    launcher, tree = _launched([sys.executable, "-c", code, str(config)], config)
    _kill_and_watch(launcher, tree, TIMEOUT_S)  # the forkserver and the ranks' workers too


STUCK_RANK = """
import os, pathlib, sys, time
import torch.utils.data
from ups.core.launch._lifeline import die_with_loader

class Stuck(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, index):
        pathlib.Path(sys.argv[1], str(os.getpid())).touch()
        time.sleep(3600)

loader = torch.utils.data.DataLoader(Stuck(), num_workers=2, worker_init_fn=die_with_loader)
next(iter(loader))
"""
"""A rank whose two loader workers are stuck in ``__getitem__``; they write their pids into
the folder ``argv[1]``."""


def test_loader_workers_stuck_in_getitem_end_with_their_rank(tmp_path: Path) -> None:
    rank = subprocess.Popen([sys.executable, "-c", STUCK_RANK, str(tmp_path)])
    try:
        wait_for(
            lambda: len(list(tmp_path.iterdir())) == 2,
            STARTED_S,
            "2 workers in __getitem__",
            process=rank,
        )
    except BaseException:
        rank.kill()
        raise
    _kill_and_watch(rank, _descendants(rank.pid), 5.0)


def test_a_rank_whose_launcher_is_gone_before_it_watches_ends_at_once() -> None:
    """The race the parent-death signal leaves: the launcher ended before the rank asked for
    it (the rank has another parent by then); the rank ends when it asks."""
    code = "from ups.core.launch._lifeline import watch_starter; watch_starter(); print('lived')"
    env = os.environ | {"UPS_LAUNCHER_PID": str(os.getpid() + 1_000_000)}  # not its parent
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (-signal.SIGKILL, "")


def test_a_rank_under_its_launcher_lives_and_hides_the_launcher_from_its_children() -> None:
    code = (
        "import os; from ups.core.launch._lifeline import LAUNCHER, watch_starter; watch_starter(); "
        "print(LAUNCHER in os.environ)"
    )
    env = os.environ | {"UPS_LAUNCHER_PID": str(os.getpid())}  # its parent: this process
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "False\n")
