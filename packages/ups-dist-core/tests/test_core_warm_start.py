"""A warm start (``model.init_from``): a fresh run starts from another run's weights, exactly as
a factory loading them by hand would, on 2 gloo ranks; a resumed run does not load them again;
weights that do not fit are one line; ``strict: false`` says what it left out in one line each;
a source that is not there is refused before any rank starts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import structlog
import torch
from torch import nn

from ups.core import ConfigError, RunContext
from ups.core.checkpoint import COMMIT_FILE
from ups.core.checkpoint._weights import COMMIT_FILE as NAMED_WITHOUT_TORCH
from ups.core.config._config import InitFrom
from ups.core.engine._model import warm_start
from ups.core.testing import assert_bitwise_equal, read_checkpoint, run_ups, tiny_project

BY_HAND = """
import torch
from tiny import build_model as tiny_model


def build_model(path):
    model = tiny_model()
    model.load_state_dict(torch.load(path, weights_only=True))
    return model
"""


def _train(config: Path, *overrides: str) -> None:
    args = [item for override in overrides for item in ("-o", override)]
    result = run_ups("train", str(config), "--nproc", "2", *args, cwd=config.parent)
    assert result.returncode == 0, result.stderr[-3000:]


def _model(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    state = read_checkpoint(run_dir / "checkpoints" / f"step-{step}")["state"]
    return dict(state["model"])


@pytest.mark.slow
def test_a_warm_start_trains_as_weights_loaded_by_hand_and_a_resume_does_not_reload(
    tmp_path: Path,
) -> None:
    source = tiny_project(tmp_path / "source", training={"max_steps": 3})
    _train(source)
    weights = tmp_path / "weights.pt"
    exported = run_ups("export", str(source.parent / "runs" / "tiny"), "--output", str(weights))
    assert exported.returncode == 0, exported.stderr
    # by hand: a factory that loads the file itself
    hand = tiny_project(tmp_path / "hand", training={"max_steps": 4}, checkpoint={"every_steps": 2})
    (hand.parent / "by_hand.py").write_text(BY_HAND)
    _train(hand, "model.factory=by_hand.py:build_model", f"model.options.path={weights}")
    # a warm start from the same file, stopped at step 2, then resumed to step 4
    warm = tiny_project(
        tmp_path / "warm",
        model={"factory": "tiny.py:build_model", "init_from": {"path": str(weights)}},
        training={"max_steps": 2},
        checkpoint={"every_steps": 2},
    )
    _train(warm)
    torch.save({k: torch.zeros_like(v) for k, v in torch.load(weights).items()}, weights)
    _train(warm, "checkpoint.resume=latest", "training.max_steps=4")  # would load zeros
    assert_bitwise_equal(
        _model(warm.parent / "runs" / "tiny", 4), _model(hand.parent / "runs" / "tiny", 4)
    )


@pytest.mark.slow
def test_a_warm_start_from_a_run_folder_and_weights_that_do_not_fit(tmp_path: Path) -> None:
    source = tiny_project(tmp_path / "source", training={"max_steps": 2})
    _train(source)
    run_dir = source.parent / "runs" / "tiny"
    warm = tiny_project(
        tmp_path / "warm",
        model={"factory": "tiny.py:build_model", "init_from": {"path": str(run_dir)}},
        training={"max_steps": 1, "lr": 1e-12},
    )
    _train(warm)
    found, started = _model(warm.parent / "runs" / "tiny", 1), _model(run_dir, 2)
    for name in started:  # one step of a negligible learning rate
        torch.testing.assert_close(found[name], started[name], rtol=0, atol=1e-9)
    wider = run_ups("train", str(warm), "-o", "model.options.width=16", cwd=warm.parent)
    assert wider.returncode == 2
    failed = [line for line in wider.stderr.splitlines() if line.startswith("ups: ")]
    assert failed == [
        f"ups: error: model.init_from: the model does not match {run_dir}/checkpoints/step-2: "
        "0.weight: [8, 4] saved, [16, 4] in the model; 0.bias: [8] saved, [16] in the model; "
        "2.weight: [1, 8] saved, [1, 16] in the model; start from weights of this model, or "
        "set model.init_from.strict: false to load the names both have (shapes must still "
        "agree)"
    ], wider.stderr[-3000:]
    assert "Traceback" not in wider.stderr


def test_a_source_that_is_not_there_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    config = tiny_project(
        tmp_path, model={"factory": "tiny.py:build_model", "init_from": {"path": str(missing)}}
    )
    result = run_ups("train", str(config), "--nproc", "2", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"ups: error: model.init_from: {missing} does not exist"
    ]
    assert not (tmp_path / "runs").exists()  # no rank started
    (tmp_path / "folder").mkdir()
    best = run_ups(
        "validate", str(config),
        "-o", f"model.init_from.path={tmp_path / 'folder'}",
        "-o", "model.init_from.weights=best",
    )  # fmt: skip
    assert best.returncode == 2
    assert best.stderr.strip().splitlines() == [
        f"ups: error: model.init_from: {tmp_path / 'folder'} is neither a run folder (with "
        "config.yaml), a checkpoint folder (with COMMIT) nor a file holding a state_dict"
    ]


def test_loose_loading_says_what_it_left_out_in_one_line_each(tmp_path: Path) -> None:
    saved = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.Linear(1, 1))
    path = tmp_path / "weights.pt"
    torch.save(saved.state_dict(), path)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.Tanh(), nn.Linear(1, 2))
    with structlog.testing.capture_logs() as logs:
        warm_start(model, InitFrom(path=str(path), strict=False), RunContext())
    said = [log["event"] for log in logs if log["log_level"] == "warning"]
    assert said == [
        f"model.init_from: not in {path}, left as built: 4.weight, 4.bias",
        f"model.init_from: in {path}, not in the model, ignored: 3.weight, 3.bias",
    ]
    assert torch.equal(model[0].weight, saved[0].weight)
    shifted = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with pytest.raises(ConfigError, match=r"2.weight: \[1, 8\] saved, \[2, 8\] in the model"):
        warm_start(shifted, InitFrom(path=str(path), strict=False), RunContext())


def test_a_checkpoint_folder_and_its_state_file_are_sources_too(tmp_path: Path) -> None:
    """Without a run: the same weights from a checkpoint's folder and from its ``state.pt``."""
    model = nn.Linear(2, 2)
    folder = tmp_path / "step-1"
    folder.mkdir()
    torch.save({"format": 1, "model": model.state_dict()}, folder / "state.pt")
    (folder / COMMIT_FILE).write_text("{}")
    for source in (folder, folder / "state.pt"):
        fresh = nn.Linear(2, 2)
        warm_start(fresh, InitFrom(path=str(source)), RunContext())
        assert_bitwise_equal(dict(fresh.state_dict()), dict(model.state_dict()))
    shutil.rmtree(folder)
    assert NAMED_WITHOUT_TORCH == COMMIT_FILE
