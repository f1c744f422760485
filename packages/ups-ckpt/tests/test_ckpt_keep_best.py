"""Keep-best (``checkpoint.options.keep_best``) on ups-ckpt's backends: ``local``,
``sharded`` and ``fsspec`` (against a moto S3 server), written in the foreground and in the
background (``async_save``), by 2 gloo ranks stopped and resumed. The best checkpoints survive
retention, ``best`` names the best of them, the resumed run goes on ranking them, and the
model a run folder's ``best`` gives (``ups.core.load_model``) is that checkpoint's."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ups.ckpt.plugin import ups_checkpoint_backends
from ups.core import Committing, RunContext, TrainResult, load_config, load_model, structure, train
from ups.core.testing import assert_bitwise_equal, tiny_project

if TYPE_CHECKING:
    from s3 import S3Prefix

pytest_plugins = ["s3"]  # the moto server and the `s3` fixture

EVAL = {"factory": "tiny.py:build_dataset", "options": {"n": 67}, "every_steps": 2}
KEEP = {"keep_best": {"monitor": "val_loss", "count": 2}, "keep_last": 1}


def run(folder: Path, options: dict[str, Any], backend: str, max_steps: int) -> TrainResult:
    """Train the tiny project on 2 ranks up to ``max_steps``, resuming from the latest."""
    config = tiny_project(
        folder,
        eval=EVAL,
        training={"epochs": 6, "max_steps": max_steps},
        checkpoint={"name": backend, "every_steps": 5, "resume": "latest", "options": options},
    )
    return train(load_config(config), nproc=2)


def storage_of(run_dir: Path, backend: str, options: dict[str, Any]) -> Committing:
    """The run's checkpoints as its backend keeps them, read in this process."""
    record = {r.name: r for r in ups_checkpoint_backends()}[backend].loaded()
    built = structure(record.options, {**options, "async_save": False})
    found = record.factory(ctx=RunContext(), directory=run_dir, options=built)
    assert isinstance(found, Committing)
    return found


@pytest.mark.parametrize(
    ("backend", "async_save"),
    [("local", False), ("local", True), ("sharded", True), ("fsspec", True)],
)
def test_the_best_survive_retention_and_a_resume_on_two_ranks(
    tmp_path: Path, request: pytest.FixtureRequest, backend: str, async_save: bool
) -> None:
    options: dict[str, Any] = {**KEEP, "async_save": async_save}
    if backend == "fsspec":
        s3: S3Prefix = request.getfixturevalue("s3")
        options |= {"url": s3.url, "storage_options": s3.storage_options}
    first = run(tmp_path, options, backend, 12)  # ends at an evaluation
    rest = run(tmp_path, options, backend, 20)
    assert (first.steps, rest.steps) == (12, 20)

    evals = [m["loss"] for m in (*first.eval_metrics, *rest.eval_metrics)]
    assert len(evals) == 10  # steps 2, 4, ..., 20: none again at the resume
    best = [2 * (i + 1) for i in sorted(range(10), key=lambda i: (evals[i], i))[:2]]
    assert rest.best is not None and rest.best[0] == best[0]
    assert rest.best[1] == pytest.approx(evals[best[0] // 2 - 1], abs=1e-6)

    run_dir = tmp_path / "runs" / "tiny"
    kept = storage_of(run_dir, backend, options)
    assert [c.step for c in kept.committed()] == sorted({*best, 20})  # keep_last: 1
    assert (kept.storage.read_pointer("best") or "").strip() == f"step-{best[0]}"
    latest = kept.load_latest()
    assert latest is not None and list(latest.state["best"]) == best
    loaded = kept.load_best()
    assert loaded is not None and loaded.step == best[0]
    model = load_model(run_dir, weights="best")
    assert_bitwise_equal(dict(model.state_dict()), dict(loaded.state["model"]))
