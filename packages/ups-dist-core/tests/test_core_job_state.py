"""``ups.core.JobState``, what a launcher's ``status`` returns: a ``str`` enum, so that the
states and the plain strings a third-party launcher returns are one and the same to ``ups``
(``TERMINAL``, the held states, what ``ups status`` prints). ``ups status``, ``logs --follow``
and ``cancel`` with a launcher returning plain strings: test_core_cli_launch.py."""

from __future__ import annotations

import typing

from ups.core import TERMINAL, JobState, Launcher
from ups.core.launch._record import HELD, held_note


def test_a_state_is_its_own_name_as_a_string() -> None:
    for state in JobState:
        assert state == state.name == str(state) == f"{state}" and JobState(state.name) is state
        assert hash(state) == hash(state.name)  # a key of a dict of strings finds it
        assert (state in TERMINAL) == (state.name in TERMINAL)
        assert held_note(state, "run") == held_note(state.name, "run")


def test_every_state_has_ended_or_is_a_live_one() -> None:
    assert set(JobState) - set(TERMINAL) == {"PENDING", "RUNNING"}
    assert set(HELD) <= set(TERMINAL)


def test_a_launchers_status_returns_a_job_state() -> None:
    assert typing.get_type_hints(Launcher.status)["return"] is JobState
