"""Ranks forked from ups's forkserver, which imported torch once: in the
launcher's environment at the launch, not at the forkserver's start, with the agent's variables
on top."""

from __future__ import annotations

import os

import pytest

from ups.core import RunContext, UsageError, run_processes
from ups.core.testing import run_ranks

os.environ["UPS_TEST_STALE"] = "1"  # at collection: before the forkserver starts


def what_the_rank_sees(ctx: RunContext) -> dict[str, object]:
    from ups.core.launch import _forkserver as forkserver

    return {
        "forked": os.getpid() != forkserver._IMPORTED_BY,  # from a server that preloaded it
        "stale at start": "UPS_TEST_STALE" in forkserver._ENVIRONMENT,
        "stale": os.environ.get("UPS_TEST_STALE"),
        "new": os.environ.get("UPS_TEST_NEW"),
        "rank": (os.environ.get("RANK"), ctx.rank),
    }


@pytest.fixture
def launcher_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    run_processes(what_the_rank_sees, nproc=2)  # the forkserver is running
    monkeypatch.delenv("UPS_TEST_STALE")
    monkeypatch.setenv("UPS_TEST_NEW", "now")


def test_run_processes_forks_ranks_in_the_launchers_environment_of_now(
    launcher_changed: None,
) -> None:
    seen = run_processes(what_the_rank_sees, nproc=2)
    assert seen == {
        "forked": True,
        "stale at start": True,
        "stale": None,
        "new": "now",
        "rank": ("0", 0),
    }


def test_run_ranks_forks_ranks_in_the_launchers_environment_of_now(launcher_changed: None) -> None:
    seen = run_ranks(what_the_rank_sees, 2)
    assert [s["rank"] for s in seen] == [("0", 0), ("1", 1)]
    assert all(s["forked"] and s["stale at start"] for s in seen)
    assert {(s["stale"], s["new"]) for s in seen} == {(None, "now")}


def test_ups_start_method_spawn_spawns_and_a_bad_value_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UPS_START_METHOD", "spawn")
    monkeypatch.setenv("UPS_TEST_NEW", "spawned")
    seen = run_ranks(what_the_rank_sees, 2)
    assert [(s["forked"], s["new"], s["rank"]) for s in seen] == [
        (False, "spawned", ("0", 0)),
        (False, "spawned", ("1", 1)),
    ]
    monkeypatch.setenv("UPS_START_METHOD", "fork")
    with pytest.raises(UsageError, match=r"^UPS_START_METHOD='fork': allowed: forkserver, spawn$"):
        run_processes(what_the_rank_sees, nproc=2)
