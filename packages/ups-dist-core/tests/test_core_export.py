"""A run's trained weights out of its folder: ``ups export`` writes a plain ``state_dict`` that
``torch.load(weights_only=True)`` reads, equal to the checkpoint's model; ``load_model`` builds
the model in a fresh process with no process group; a run folder copied elsewhere (with its
project) still loads, its ``config.yaml`` keeping paths relative to it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ups.core import config_from_mapping
from ups.core.config._config import _resolve_paths, relative_paths
from ups.core.testing import assert_bitwise_equal, read_checkpoint, run_ups, tiny_project

LOAD = """
import sys
import torch
import torch.distributed as dist
import ups.core

model = ups.core.load_model(sys.argv[1])
assert not dist.is_initialized()
torch.save(model.state_dict(), sys.argv[2])
"""


@pytest.mark.slow
def test_export_and_load_model_give_the_checkpoints_weights_from_a_copied_folder(
    tmp_path: Path,
) -> None:
    config = tiny_project(tmp_path / "project", training={"max_steps": 3})
    trained = run_ups("train", str(config), "--nproc", "2", cwd=config.parent)
    assert trained.returncode == 0, trained.stderr[-3000:]
    saved = read_checkpoint(config.parent / "runs" / "tiny" / "checkpoints" / "step-3")
    expected = dict(saved["state"]["model"])
    # the project and its run, moved elsewhere: nothing of the old place is left
    moved = tmp_path / "elsewhere"
    shutil.copytree(config.parent, moved)
    shutil.rmtree(config.parent)
    run_dir = moved / "runs" / "tiny"

    output = tmp_path / "out" / "model.pt"
    exported = run_ups("export", str(run_dir), "--output", str(output))
    assert exported.returncode == 0, exported.stderr
    assert_bitwise_equal(dict(torch.load(output, weights_only=True)), expected)

    loaded = tmp_path / "loaded.pt"
    fresh = subprocess.run(
        [sys.executable, "-c", LOAD, str(run_dir), str(loaded)], capture_output=True, text=True
    )
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert_bitwise_equal(dict(torch.load(loaded, weights_only=True)), expected)


@pytest.mark.slow
def test_the_ema_exports_and_warm_starts_a_run_on_two_ranks(tmp_path: Path) -> None:
    """``--weights ema`` writes the checkpoint's ``ema.model``, and ``model.init_from`` with
    ``weights: ema`` starts a 2-rank run from it, not from the live weights."""
    source = tiny_project(tmp_path / "source", training={"max_steps": 3, "ema": {"decay": 0.5}})
    trained = run_ups("train", str(source), "--nproc", "2", cwd=source.parent)
    assert trained.returncode == 0, trained.stderr[-3000:]
    run_dir = source.parent / "runs" / "tiny"
    saved = read_checkpoint(run_dir / "checkpoints" / "step-3")["state"]
    averaged, live = dict(saved["ema"]["model"]), dict(saved["model"])
    assert any(not torch.equal(averaged[name], live[name]) for name in live)

    output = tmp_path / "ema.pt"
    exported = run_ups("export", str(run_dir), "--weights", "ema", "--output", str(output))
    assert exported.returncode == 0, exported.stderr
    assert_bitwise_equal(dict(torch.load(output, weights_only=True)), averaged)

    warm = tiny_project(
        tmp_path / "warm",
        model={
            "factory": "tiny.py:build_model",
            "init_from": {"path": str(run_dir), "weights": "ema"},
        },
        training={"max_steps": 1, "lr": 1e-12},
    )
    started = run_ups("train", str(warm), "--nproc", "2", cwd=warm.parent)
    assert started.returncode == 0, started.stderr[-3000:]
    found = read_checkpoint(warm.parent / "runs" / "tiny" / "checkpoints" / "step-1")
    for name, value in averaged.items():  # one step of a negligible learning rate
        torch.testing.assert_close(found["state"]["model"][name], value, rtol=0, atol=1e-9)


def test_export_refuses_what_it_cannot_export_in_one_line(tmp_path: Path) -> None:
    output = str(tmp_path / "model.pt")
    (tmp_path / "empty").mkdir()
    for args, said in [
        (
            [str(tmp_path / "empty")],
            f"RUN_DIR: {tmp_path / 'empty'} is neither a run folder (with config.yaml), a "
            "checkpoint folder (with COMMIT) nor a file holding a state_dict",
        ),
        ([str(tmp_path / "nowhere")], f"RUN_DIR: {tmp_path / 'nowhere'} does not exist"),
        (
            [str(tmp_path / "empty"), "--weights", "best"],
            f"RUN_DIR: {tmp_path / 'empty'} is neither a run folder (with config.yaml), a "
            "checkpoint folder (with COMMIT) nor a file holding a state_dict",
        ),
    ]:
        result = run_ups("export", *args, "--output", output)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [f"ups: error: {said}"]
    (tmp_path / "empty" / "config.yaml").write_text("{}")
    best = run_ups("export", str(tmp_path / "empty"), "--weights", "best", "--output", output)
    assert best.returncode == 2
    assert best.stderr.strip().splitlines() == [
        "ups: error: --weights: weights 'best' needs a run saved with "
        f"checkpoint.options.keep_best; the run of {tmp_path / 'empty'} kept no best "
        "checkpoints: use latest"
    ]
    assert not Path(output).exists()


def test_a_weights_choice_the_source_cannot_give_is_one_line_naming_weights(
    tmp_path: Path,
) -> None:
    """``--weights`` (``weights``, ``model.init_from.weights``) is named for a choice of
    weights its source lacks: an EMA of a file's, or of a checkpoint of a run without one."""
    from ups.core import load_model

    folder = tmp_path / "step-1"
    folder.mkdir()
    torch.save({"format": 1, "model": torch.nn.Linear(2, 2).state_dict()}, folder / "state.pt")
    (folder / "COMMIT").write_text("{}")
    output = str(tmp_path / "model.pt")
    for source, said in [
        (
            folder / "state.pt",
            f"weights 'ema' is for a run or checkpoint folder; {folder / 'state.pt'} is a "
            "file: use latest",
        ),
        (folder, f"{folder} holds no EMA of the weights: its run had no training.ema; use latest"),
    ]:
        result = run_ups("export", str(source), "--weights", "ema", "--output", output)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [f"ups: error: --weights: {said}"]
    assert not Path(output).exists()
    (tmp_path / "config.yaml").write_text("{}")
    with pytest.raises(ValueError, match=r"^weights: weights 'best' needs a run saved with"):
        load_model(tmp_path, weights="best")


def test_load_model_refuses_a_folder_that_is_no_run_folder(tmp_path: Path) -> None:
    from ups.core import load_model

    (tmp_path / "COMMIT").write_text("{}")  # a checkpoint's folder
    with pytest.raises(
        ValueError, match=r"^run_dir: .* is no run folder \(no config.yaml in it\)$"
    ):
        load_model(tmp_path)


names = st.lists(st.sampled_from(["a", "b", "src", "..", "my project"]), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(model=names, run=names)
def test_the_saved_config_reads_back_as_it_ran_from_the_run_folder(
    tmp_path_factory: pytest.TempPathFactory, model: list[str], run: list[str]
) -> None:
    """``config.yaml``'s paths, relative to the run folder, resolve from it to the run's."""
    base = tmp_path_factory.mktemp("project") / "deep" / "er"
    config = config_from_mapping(
        {
            "model": {"factory": "/".join([*model, "m.py:build"]), "init_from": {"path": "w.pt"}},
            "data": {"factory": "pkg.data:build"},
        },
        base,
    )
    folder = base.joinpath(*run)
    saved = relative_paths(config, folder)
    assert saved.data.factory == "pkg.data:build"
    assert not Path(saved.model.factory.rpartition(":")[0]).is_absolute()
    assert _resolve_paths(saved, folder.resolve()) == config
