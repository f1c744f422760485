"""The helpers the tests share, in :mod:`ups.core.testing`: ``run_ups``, ``events`` and
``wait_for``. Real processes and files."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ups.core.testing import events, install_plugin, run_ups, wait_for

RECORDS = st.lists(
    st.fixed_dictionaries(
        {"event": st.sampled_from(["step", "done", "resumed"]), "step": st.integers(0, 99)}
    )
)
NOISE = st.lists(st.text(alphabet="ups: error 0123", max_size=20))
"""Lines the launcher writes besides the JSON events (none starts with ``{``)."""


@given(records=RECORDS, noise=NOISE, name=st.sampled_from([None, "step", "done"]))
def test_events_of_text_are_its_json_lines_in_order_named_as_asked(
    records: list[dict[str, object]], noise: list[str], name: str | None
) -> None:
    lines = [json.dumps(r) for r in records]
    for i, said in enumerate(noise):  # interleaved
        lines.insert(min(2 * i, len(lines)), said)
    expected = [r for r in records if name is None or r["event"] == name]
    assert events("\n".join(lines), name) == expected


def test_events_of_a_log_file_are_every_line_and_a_line_not_json_is_an_error(
    tmp_path: Path,
) -> None:
    log = tmp_path / "rank0.jsonl"
    log.write_text('{"event": "step", "step": 2}\n{"event": "done", "steps": 4}\n')
    assert events(log) == [{"event": "step", "step": 2}, {"event": "done", "steps": 4}]
    assert events(log, "done") == [{"event": "done", "steps": 4}]
    log.write_text('{"event": "step", "step": 2}\nups: not an event\n')
    with pytest.raises(json.JSONDecodeError):
        events(log)


def test_wait_for_returns_once_the_condition_holds() -> None:
    calls: list[None] = []

    def third_time() -> bool:
        calls.append(None)
        return len(calls) == 3

    wait_for(third_time, 10, "the third call")
    assert len(calls) == 3


def test_wait_for_names_what_it_waited_for_when_it_times_out() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        wait_for(lambda: False, 0.2, "a file", details=lambda: "the log says so")
    assert str(failed.value) == "timed out after 0.2 s while waiting for a file\nthe log says so"
    assert time.monotonic() - started >= 0.2


def test_wait_for_fails_at_once_when_the_process_it_watches_exits() -> None:
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        wait_for(lambda: False, 120, "its first step", process=process)
    assert str(failed.value) == (
        f"the process {process.pid} exited with status 3 while waiting for its first step"
    )
    assert time.monotonic() - started < 60


def test_run_ups_adds_env_to_the_environment_and_runs_in_cwd(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, "ups-broken", "ups_broken", "raise RuntimeError('half-installed')\n")
    result = run_ups("plugins", cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ups-broken" in result.stdout
    (warning,) = events(result.stderr, "plugin failed to load; skipped")
    assert "half-installed" in json.dumps(warning)
