"""Retention: the rule (``expired``) as properties, and what it deletes in a real folder (the
built-in ``simple`` backend's)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ups.core import RunContext, SimpleCheckpointer, SimpleCheckpointOptions, expired

SINGLE = RunContext()

steps_lists = st.lists(st.integers(0, 60), max_size=15)
keep_lasts = st.one_of(st.none(), st.integers(1, 8))
keep_everys = st.one_of(st.none(), st.integers(1, 12))


@st.composite
def retention_cases(draw: st.DrawFn) -> dict[str, Any]:
    steps = draw(steps_lists)
    protected = draw(st.one_of(st.none(), st.sampled_from(steps or [0]), st.integers(0, 60)))
    return {
        "steps": steps,
        "keep_last": draw(keep_lasts),
        "keep_every": draw(keep_everys),
        "protected": protected,
    }


@settings(max_examples=300, deadline=None)
@given(retention_cases())
def test_only_given_steps_are_deleted_once_each_oldest_first(case: dict[str, Any]) -> None:
    deleted = expired(**case)
    assert set(deleted) <= set(case["steps"])
    assert deleted == sorted(set(deleted))


@settings(max_examples=300, deadline=None)
@given(retention_cases())
def test_the_protected_step_is_never_deleted(case: dict[str, Any]) -> None:
    assert case["protected"] not in expired(**case)


@settings(max_examples=300, deadline=None)
@given(retention_cases())
def test_the_newest_keep_last_are_kept(case: dict[str, Any]) -> None:
    deleted = set(expired(**case))
    if case["keep_last"] is not None:
        newest = sorted(set(case["steps"]))[-case["keep_last"] :]
        assert not deleted & set(newest)


@settings(max_examples=300, deadline=None)
@given(retention_cases())
def test_multiples_of_keep_every_are_kept(case: dict[str, Any]) -> None:
    deleted = expired(**case)
    if case["keep_every"] is not None:
        assert not [step for step in deleted if step % case["keep_every"] == 0]


@settings(max_examples=100, deadline=None)
@given(steps_lists, keep_everys, st.one_of(st.none(), st.integers(0, 60)))
def test_keep_last_none_deletes_nothing(
    steps: list[int], keep_every: int | None, protected: int | None
) -> None:
    assert expired(steps, keep_last=None, keep_every=keep_every, protected=protected) == []


@settings(max_examples=300, deadline=None)
@given(retention_cases(), st.randoms(use_true_random=False))
def test_everything_else_is_deleted_whatever_the_order(case: dict[str, Any], rnd: Any) -> None:
    """The rule is exactly: delete what no reason keeps (and the order of ``steps`` is moot)."""
    steps, keep_last, keep_every = case["steps"], case["keep_last"], case["keep_every"]
    kept = set(steps) if keep_last is None else set(sorted(set(steps))[-keep_last:])
    kept |= {case["protected"]} | {s for s in steps if keep_every and s % keep_every == 0}
    shuffled = list(steps)
    rnd.shuffle(shuffled)
    assert expired(**case) == sorted(set(steps) - kept)
    assert expired(**{**case, "steps": shuffled}) == expired(**case)


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "message"),
    [(0, None, "keep_last must be >= 1 or None, got 0"), (2, 0, "keep_every must be >= 1")],
)
def test_keeping_nothing_is_refused(keep_last: int, keep_every: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expired([1, 2, 3], keep_last=keep_last, keep_every=keep_every)


# ---------------------------------------------------------------------------------------------
# In a real folder


def visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@settings(max_examples=15, deadline=None)
@given(
    saves=st.lists(st.integers(0, 12), min_size=1, max_size=6),
    keep_last=keep_lasts.filter(lambda k: k is None or k <= 3),
    keep_every=st.one_of(st.none(), st.integers(2, 4)),
)
def test_a_folder_keeps_what_the_rule_keeps_and_latest_always_loads(
    saves: list[int], keep_last: int | None, keep_every: int | None
) -> None:
    """Saves at any steps (a step saved again after resuming from an older one included): the
    folder holds exactly the steps the rule keeps, ``latest`` names the step just saved, and
    it loads with that save's state."""
    options = SimpleCheckpointOptions(keep_last=keep_last, keep_every=keep_every)
    with tempfile.TemporaryDirectory() as directory:
        ckpt = SimpleCheckpointer(ctx=SINGLE, directory=Path(directory), options=options)
        folder = Path(directory) / "checkpoints"
        model: set[int] = set()
        for number, step in enumerate(saves):
            ckpt.save({"save": number}, step=step, rank_state={"n": torch.tensor(number)})
            model.add(step)
            model -= set(expired(sorted(model), **_rule(keep_last, keep_every, step)))
            assert step in model
            assert visible(folder) == sorted(["latest", *(f"step-{s}" for s in model)])
            assert (folder / "latest").read_text() == f"step-{step}\n"
            loaded = ckpt.load_latest()
            assert loaded is not None and loaded.rank_state is not None
            assert (loaded.step, loaded.state["save"]) == (step, number)
            assert int(loaded.rank_state["n"]) == number


def _rule(keep_last: int | None, keep_every: int | None, protected: int) -> dict[str, Any]:
    return {"keep_last": keep_last, "keep_every": keep_every, "protected": protected}


def test_keep_every_keeps_multiples_in_the_folder(tmp_path: Path) -> None:
    options = SimpleCheckpointOptions(keep_last=2, keep_every=4)
    ckpt = SimpleCheckpointer(ctx=SINGLE, directory=tmp_path, options=options)
    for step in range(1, 11):
        ckpt.save({"step": step}, step=step, rank_state={})
    assert [c.step for c in ckpt.committed()] == [4, 8, 9, 10]
