"""Per-rank log files, the console's per-rank threshold, and the rank-0 progress bar."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from ups.core.dist._context import RunContext
from ups.core.observe import _logs as logs
from ups.core.observe._progress import Progress
from ups.core.testing import events, run_ranks, tiny_project

log = structlog.get_logger()


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def fresh_structlog() -> Iterator[None]:
    """Leave structlog's configuration as it was before the test configured it."""
    yield
    structlog.reset_defaults()


def shown(raw: str) -> str:
    """What a terminal shows of a line written with carriage returns: each part overwrites the
    line from its first column."""
    text = ""
    for part in raw.split("\r"):
        text = part + text[len(part) :]
    return text.rstrip()


def log_in_rank_file(ctx: RunContext, run_dir: Path) -> str:
    """Configure the console into a buffer, log inside and after ``rank_log_file``; return what
    the console got."""
    console = io.StringIO()
    stderr, sys.stderr = sys.stderr, console
    try:
        logs.configure(ctx, fmt="json")
        with logs.rank_log_file(ctx, run_dir) as path:
            assert path == run_dir / "logs" / f"rank{ctx.rank}.jsonl"
            log.info("hello", step=7)
            log.debug("detail")
            log.warning("careful")
        log.info("after")
    finally:
        sys.stderr = stderr
    return console.getvalue()


@pytest.mark.slow
def test_every_rank_files_its_info_events_while_the_console_of_rank_1_only_warns(
    tmp_path: Path,
) -> None:
    consoles = run_ranks(log_in_rank_file, 2, tmp_path)
    for rank in (0, 1):
        records = events(tmp_path / "logs" / f"rank{rank}.jsonl")
        assert [(r["event"], r["level"], r["rank"]) for r in records] == [
            ("hello", "info", rank),
            ("careful", "warning", rank),
        ]
        assert records[0]["step"] == 7
        assert all("timestamp" in r for r in records)
    # Rank 0's console shows info (once each, the file adds nothing); rank 1's only warnings.
    assert [(e["event"], e["rank"]) for e in events(consoles[0])] == [
        ("hello", 0),
        ("careful", 0),
        ("after", 0),
    ]
    assert [(e["event"], e["rank"]) for e in events(consoles[1])] == [("careful", 1)]


def test_rank_log_file_appends_and_leaves_the_processors_as_it_found_them(
    tmp_path: Path,
) -> None:
    ctx = RunContext()
    with capture_logs() as seen:
        before = list(structlog.get_config()["processors"])
        with logs.rank_log_file(ctx, tmp_path) as path:
            log.info("one")
        with logs.rank_log_file(ctx, tmp_path):
            try:
                raise ValueError("boom")
            except ValueError:
                log.exception("failed")
        log.info("not filed")
        assert structlog.get_config()["processors"] == before
    records = events(path)
    assert [(r["event"], r["level"], r["rank"]) for r in records] == [
        ("one", "info", 0),
        ("failed", "error", 0),
    ]
    assert "ValueError: boom" in records[1]["exception"]
    # What other processors see is not changed by the file's.
    assert [e["event"] for e in seen] == ["one", "failed", "not filed"]
    assert "rank" not in seen[0]


def test_an_enabled_bar_shows_the_latest_loss_and_reaches_the_total() -> None:
    screen = io.StringIO()
    with Progress(RunContext(), 20, file=screen, enabled=True) as bar:
        assert bar.enabled
        for step in range(1, 21):
            metrics = {"loss": 1 / step, "lr": 0.1, "loss/a": 2.0, "samples_per_s": 1234.5}
            bar.update(step, metrics)
            if step == 10:
                bar.update(step, {"val_loss": 0.5})  # shown until the next evaluation
    last = shown(screen.getvalue().rstrip("\n").split("\n")[-1])
    assert "20/20" in last
    assert "loss=0.05, a=2, val_loss=0.5, 1234 samples/s" in last
    assert "lr" not in last


def test_a_bar_defaults_to_shown_on_a_terminal_only() -> None:
    terminal = Terminal()
    with Progress(RunContext(), 3, file=terminal) as bar:
        bar.update(3)
    assert "3/3" in terminal.getvalue()
    piped = io.StringIO()
    with Progress(RunContext(), 3, file=piped) as bar:
        assert not bar.enabled
        bar.update(3, {"loss": 1.0})
    assert piped.getvalue() == ""


def test_a_bar_is_never_shown_on_other_ranks() -> None:
    terminal = Terminal()
    with Progress(RunContext(rank=1, world_size=2), 3, file=terminal, enabled=True) as bar:
        assert not bar.enabled
        bar.update(3, {"loss": 1.0})
    assert terminal.getvalue() == ""


@pytest.mark.usefixtures("fresh_structlog")
def test_a_log_line_written_while_a_bar_is_open_is_shown_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    logs.configure(RunContext(), fmt="json")
    with Progress(RunContext(), 10, file=terminal) as bar:
        bar.update(5, {"loss": 0.5})
        log.info("checkpoint saved", step=5)
        bar.update(10, {"loss": 0.25})
    lines = terminal.getvalue().split("\n")
    [logged] = [line for line in lines if "checkpoint saved" in line]
    assert json.loads(shown(logged))["event"] == "checkpoint saved"
    # The bar is drawn again after the line and ends complete.
    assert "10/10" in shown(lines[-2])
    assert "loss=0.25" in shown(lines[-2])


def test_ups_train_on_a_terminal_shows_a_bar_not_step_lines_and_ends_saying_where_its_files_are(
    tmp_path: Path,
) -> None:
    config = tiny_project(
        tmp_path, eval={"factory": "tiny.py:build_dataset", "options": {"n": 16}, "every_steps": 4}
    )
    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 200, 0, 0))  # 200 columns
    env = {k: v for k, v in os.environ.items() if k != logs.FORMAT_ENV}
    process = subprocess.Popen(
        [sys.executable, "-m", "ups.core", "train", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=child,
        stderr=child,
        env=env,
    )
    os.close(child)
    raw = b""
    with contextlib.suppress(OSError):  # EIO once the process has closed the terminal
        while chunk := os.read(parent, 4096):
            raw += chunk
    os.close(parent)
    assert process.wait(timeout=60) == 0
    lines = [shown(line) for line in raw.decode().splitlines()]
    bar = next(line for line in reversed(lines) if "8/8" in line)
    assert re.search(r"8/8 \[.*, loss=[\d.e-]+, val_loss=[\d.e-]+, \d+ samples/s\]", bar), bar
    assert not any("step_time_s" in line for line in lines)  # no step line of every metric
    folder = tmp_path / "runs" / "tiny"
    assert lines[-1] == f"ups: the run's files are in {folder}; plot them: ups report {folder}"
    records = [
        json.loads(line) for line in (folder / "logs" / "rank0.jsonl").read_text().split("\n")[:-1]
    ]
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == [2, 4, 6, 8] and "step_time_s" in steps[0]
