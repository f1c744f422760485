"""The best checkpoint of a run with keep-best (``checkpoint.options.keep_best``) out of its
folder: ``ups export --weights best``, ``ups.core.load_model(..., weights="best")`` and a warm
start (``model.init_from.weights: best``) give the model of the checkpoint ``best`` names;
the run's summary (its ``done`` line, :class:`~ups.core.TrainResult`) names it; a source that
keeps no best checkpoint is one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ups.core import TrainResult, load_config, load_model, train
from ups.core.testing import assert_bitwise_equal, events, read_checkpoint, run_ups, tiny_project

EVAL = {"factory": "tiny.py:build_dataset", "options": {"n": 67}, "every_steps": 2}
KEEP = {"keep_best": {"monitor": "val_loss", "count": 2}, "keep_last": 1}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainResult]:
    """A 2-rank run of 12 steps keeping the 2 best by ``val_loss``, evaluated every 2 steps:
    its folder and result."""
    folder = tmp_path_factory.mktemp("source")
    config = tiny_project(
        folder,
        eval=EVAL,
        training={"epochs": 3, "max_steps": 12, "lr": 0.2},
        checkpoint={"options": KEEP},
    )
    return folder / "runs" / "tiny", train(load_config(config), nproc=2)


@pytest.fixture
def run_dir(trained: tuple[Path, TrainResult]) -> Path:
    return trained[0]


def best_step(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "best").read_text().strip().removeprefix("step-"))


def test_the_summary_names_the_best_checkpoint(trained: tuple[Path, TrainResult]) -> None:
    """The ``done`` line and the result name the step and value of the checkpoint ``best``
    names; the ``eval`` lines say it is the lowest ``val_loss`` (the earlier of equal ones)."""
    run_dir, result = trained
    logged = events(run_dir / "logs" / "rank0.jsonl")
    evals = [(e["val_loss"], e["step"]) for e in logged if e["event"] == "eval"]
    value, step = min(evals)  # logged rounded to 6 places
    (done,) = [e for e in logged if e["event"] == "done"]
    assert (done["best_step"], done["best_value"]) == result.best
    assert result.best is not None and result.best[0] == step == best_step(run_dir)
    assert result.best[1] == pytest.approx(value, abs=1e-6)
    assert step != 12  # the best is not the newest: retention would have let it go


def test_export_load_model_and_a_warm_start_of_best_give_the_checkpoint_best_names(
    run_dir: Path, tmp_path: Path
) -> None:
    expected = dict(
        read_checkpoint(run_dir / "checkpoints" / f"step-{best_step(run_dir)}")["state"]["model"]
    )
    latest = dict(read_checkpoint(run_dir / "checkpoints" / "step-12")["state"]["model"])
    assert any(not torch.equal(expected[name], latest[name]) for name in latest)
    shutil.copytree(run_dir.parent.parent, tmp_path / "copied")  # moved with its project
    copied = tmp_path / "copied" / "runs" / "tiny"
    output = tmp_path / "best.pt"
    exported = run_ups("export", str(copied), "--weights", "best", "--output", str(output))
    assert exported.returncode == 0, exported.stderr
    assert f"step-{best_step(run_dir)}" in exported.stdout
    assert_bitwise_equal(dict(torch.load(output, weights_only=True)), expected)
    assert_bitwise_equal(dict(load_model(copied, weights="best").state_dict()), expected)

    warm = tiny_project(
        tmp_path / "warm",
        model={
            "factory": "tiny.py:build_model",
            "init_from": {"path": str(run_dir), "weights": "best"},
        },
        training={"max_steps": 1, "lr": 1e-12},
    )
    started = run_ups("train", str(warm), cwd=warm.parent)
    assert started.returncode == 0, started.stderr[-3000:]
    found = read_checkpoint(warm.parent / "runs" / "tiny" / "checkpoints" / "step-1")
    for name, value in expected.items():  # one step of a negligible learning rate
        torch.testing.assert_close(found["state"]["model"][name], value, rtol=0, atol=1e-9)


def test_a_source_without_best_checkpoints_is_one_line_naming_weights(
    run_dir: Path, tmp_path: Path
) -> None:
    """A run without keep-best, a checkpoint folder, and a run whose ``best`` is not there
    yet: ``ups export`` says so in one line, exit 2, naming ``--weights``."""
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.yaml").write_text("checkpoint: {name: simple, options: {keep_last: 2}}\n")
    pending = tmp_path / "pending" / "tiny"
    shutil.copytree(run_dir, pending)
    (pending / "checkpoints" / "best").unlink()
    checkpoint = run_dir / "checkpoints" / "step-12"
    output = tmp_path / "model.pt"
    for source, said in [
        (
            plain,
            f"weights 'best' needs a run saved with checkpoint.options.keep_best; the run of "
            f"{plain} kept no best checkpoints: use latest",
        ),
        (
            checkpoint,
            "weights 'best' is for a run folder, whose 'best' pointer names its best "
            f"checkpoint; {checkpoint} is not one: give its run folder, or use latest",
        ),
        (
            pending,
            f"the run folder {pending} holds no best checkpoint yet (no evaluation has been "
            "ranked by checkpoint.options.keep_best): use latest",
        ),
    ]:
        result = run_ups("export", str(source), "--weights", "best", "--output", str(output))
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [f"ups: error: --weights: {said}"]
    assert not output.exists()
    with pytest.raises(ValueError, match=r"^weights: weights 'best' needs a run saved with"):
        load_model(plain, weights="best")
