"""Keep-best in a run of stages, on 2 gloo ranks: each stage ranks its own checkpoints (the
``best`` pointer names the last stage's best, whatever an earlier stage's values were), an
earlier stage's best stay kept, a finished stage's best weights are kept in
``stages/NAME/best.pt``, and a later stage starts from them (``model.init_from: {stage: NAME,
weights: best}``); naming the best of a stage without keep-best is one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ups.core import ConfigError, RunContext, config_from_mapping, train
from ups.core.checkpoint import SimpleCheckpointer, SimpleCheckpointOptions
from ups.core.checkpoint._best import STAGE, KeepBest, admit
from ups.core.engine._stages import runnable
from ups.core.testing import assert_bitwise_equal, read_checkpoint, run_ups, tiny_project

EVAL = {"factory": "tiny.py:build_dataset", "options": {"n": 67}, "every_steps": 2}
KEEP = {"keep_best": {"monitor": "val_loss", "count": 1}, "keep_last": 1}
SECOND = {"training": {"lr": 3.0}, "checkpoint": {"options": KEEP}}
"""The second stage: an LR so large its evaluations are worse than the first stage's best."""


keeps = st.builds(
    KeepBest,
    monitor=st.just("val_loss"),
    mode=st.sampled_from(["min", "max"]),
    count=st.integers(1, 3),
)
values = st.lists(st.floats(-3, 3, allow_nan=False), max_size=8)


@settings(max_examples=60, deadline=None)
@given(first=keeps, second=st.none() | keeps, one=values, two=values)
def test_a_later_stage_ranks_its_own_and_keeps_the_earlier_best(
    tmp_path_factory: pytest.TempPathFactory,
    first: KeepBest,
    second: KeepBest | None,
    one: list[float],
    two: list[float],
) -> None:
    """Two stages' checkpointers over one folder, ``keep_last: 1``, the second with keep-best
    or without (recording its stage with each save when it has it, as the engine does): the
    first stage's best survive the second's retention; ``best`` names the second's best once
    it ranks one, else stays at the first's."""
    folder = tmp_path_factory.mktemp("run")
    bests: list[dict[int, float]] = []
    step = 0
    for index, (keep, evaluated) in enumerate([(first, one), (second, two)]):
        options = SimpleCheckpointOptions(keep_last=1, keep_best=keep)
        checkpointer = SimpleCheckpointer(ctx=RunContext(), directory=folder, options=options)
        scores: dict[int, float] = {}
        for value in evaluated:
            step += 1
            kept = admit(scores, step, value, keep) if keep is not None else None
            scores = kept or scores
            metrics = {"val_loss": value} if kept else {}
            if keep is not None and index:
                metrics[STAGE] = float(index)
            checkpointer.save({"x": step}, step=step, metrics=metrics or None)
        bests.append(scores)
    committed = {c.step for c in checkpointer.committed()}
    assert set(bests[0]) | set(bests[1]) <= committed
    pointer = checkpointer.storage.read_pointer("best")
    named = next(iter(bests[1] or bests[0]), None)
    assert pointer == (None if named is None else f"step-{named}\n")


def _model(run_dir: Path, step: int) -> dict[str, Any]:
    return dict(read_checkpoint(run_dir / "checkpoints" / f"step-{step}")["state"]["model"])


def _bests(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["val_loss"] for line in lines if line["kind"] == "best"}


@pytest.mark.slow
def test_each_stage_ranks_its_own_checkpoints_and_keeps_its_best_weights(tmp_path: Path) -> None:
    init = {"init_from": {"stage": "first", "weights": "best"}}
    staged = tiny_project(
        tmp_path / "staged",
        eval=EVAL,
        training={"lr": 0.2, "epochs": 3},
        checkpoint={"options": KEEP},
        stages=[
            {"name": "first", "max_steps": 6},
            {"name": "second", "max_steps": 4, "overrides": {**SECOND, "model": init}},
        ],
    )
    assert train(staged, nproc=2).steps == 10
    run_dir = tmp_path / "staged" / "runs" / "tiny"
    bests = _bests(run_dir)
    first = max(step for step in bests if step <= 6)  # count 1: the last new best is the best
    second = max(step for step in bests if step > 6)
    assert bests[first] < min(v for s, v in bests.items() if s > 6)  # the first stage's better
    pointer = (run_dir / "checkpoints" / "best").read_text().strip()
    assert pointer == f"step-{second}"
    kept = sorted(int(p.name.removeprefix("step-")) for p in run_dir.glob("checkpoints/step-*"))
    assert first in kept and second in kept and 10 in kept
    best = torch.load(run_dir / "stages" / "first" / "best.pt", weights_only=True)
    assert_bitwise_equal(best, _model(run_dir, first), "stages/first/best.pt")
    # the second stage started from it: as a run of its config from that file
    by_hand = tiny_project(
        tmp_path / "by_hand",
        eval=EVAL,
        training={"lr": 3.0, "max_steps": 4, "epochs": 3},
        checkpoint={"options": KEEP},
        model={
            "factory": "tiny.py:build_model",
            "init_from": {"path": str(run_dir / "stages" / "first" / "best.pt")},
        },
    )
    assert train(by_hand, nproc=2).steps == 4
    hand_dir = tmp_path / "by_hand" / "runs" / "tiny"
    assert_bitwise_equal(_model(run_dir, 10), _model(hand_dir, 4), "the second stage's model")


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"model": {"init_from": {"stage": "a", "weights": "best"}}}, "model.init_from.stage"),
        (
            {"model": {"options": {"in_features": {"stage": "a", "weights": "best"}}}},
            "model.options.in_features",
        ),
    ],
)
def test_the_best_of_a_stage_without_keep_best_is_one_line(
    tmp_path: Path, overrides: dict[str, Any], key: str
) -> None:
    config = tiny_project(
        tmp_path, eval=EVAL, stages=[{"name": "a"}, {"name": "b", "overrides": overrides}]
    )
    result = run_ups("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"ups: error: {config}: stages[1].{key}: weights best: stage 'a' keeps no best "
        "checkpoint (it has no checkpoint.options.keep_best)"
    ]


def test_a_stage_that_kept_no_best_weights_is_one_line_where_a_later_stage_reads_them(
    tmp_path: Path,
) -> None:
    """A stage with keep-best whose evaluations were never ranked (all NaN) leaves no
    ``best.pt``; here stage ``first`` has left nothing yet: stage ``second``, which starts
    from its best, fails with one ConfigError at its key, not a FileNotFoundError."""
    stages = [
        {"name": "first", "max_steps": 2, "overrides": {"checkpoint": {"options": KEEP}}},
        {
            "name": "second",
            "max_steps": 2,
            "overrides": {"model": {"init_from": {"stage": "first", "weights": "best"}}},
        },
    ]
    config = config_from_mapping(
        yaml.safe_load(tiny_project(tmp_path, eval=EVAL, stages=stages).read_text()), tmp_path
    )
    with pytest.raises(
        ConfigError, match=r"^model\.init_from\.weights: stage 'first' kept no best"
    ):
        runnable(config, 1, torch.device("cpu"))
