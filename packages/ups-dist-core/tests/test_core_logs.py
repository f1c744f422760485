"""Per-rank log files, the console's per-rank threshold, and the rank-0 progress bar."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from ups.core import logs
from ups.core.context import RunContext
from ups.core.progress import Progress
from ups.core.testing import run_ranks

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


def events(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


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
        text = (tmp_path / "logs" / f"rank{rank}.jsonl").read_text()
        records = [json.loads(line) for line in text.splitlines()]
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
    records = [json.loads(line) for line in path.read_text().splitlines()]
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
            bar.update(step, {"loss": 1 / step, "lr": 0.1, "grad_norm": 3.0})
    last = shown(screen.getvalue().rstrip("\n").split("\n")[-1])
    assert "20/20" in last
    assert "loss=0.05, lr=0.1" in last
    assert "grad_norm" not in last


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
