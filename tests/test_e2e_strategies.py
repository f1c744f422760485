"""The sharded strategies (ups-fsdp's ``zero`` and ``fsdp``) end to end, through ``ups train``:
a rank killed mid-epoch under ``--max-restarts`` resumes from its sharded checkpoint and ends
bitwise equal to a run never stopped; a 2-rank checkpoint resumes on 1 rank and under ``ddp``;
``ups export`` reads a sharded run without a process group; the bundled multi-task example
(seed 001's shape) trains under each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_e2e_faults import (
    EXIT_PREEMPTED,
    MODEL,
    SCHEDULE,
    STATE,
    preempted,
    rank_log,
    run_dir,
    ups_train,
)
from test_e2e_resume import project

from ups.core import RunContext, load_model, load_plugins
from ups.core.testing import assert_bitwise_equal, events, run_ups, tiny_project

ROOT = Path(__file__).resolve().parents[1]
STEPS = 17
"""As test_e2e_faults's runs: 3 epochs of 8 batches, the schedule's decisions included."""


def sharded_project(folder: Path, strategy: str, backend: str = "sharded", **sections: Any) -> Path:
    """test_e2e_faults's project (the ``tensor`` sampler's position, StepLR, the schedule's
    two decisions, checkpoints every 3 steps) under ``strategy``, AdamW, clipped, without a
    comm hook (FSDP has no DDP reducer to hook)."""
    config = project(
        folder,
        STEPS,
        "none",
        "tensor",
        backend=backend,
        model=MODEL,
        optimizer="adamw",
        grad_clip_norm=0.5,
        scheduler="StepLR",
        scheduler_options={"step_size": 4, "gamma": 0.7},
    )
    mapping = yaml.safe_load(config.read_text())
    mapping.update(schedule=SCHEDULE, strategy={"name": strategy})
    for name, values in sections.items():
        mapping[name] = {**mapping.get(name, {}), **values}
    config.write_text(yaml.safe_dump(mapping))
    return config


def final(config: Path) -> dict[str, Any]:
    """The newest checkpoint's replicated state, as the ``sharded`` backend loads it in one
    process, with every rank's own state (its file) as a list under ``ranks``."""
    plugin, options = load_plugins().select("checkpoint", "sharded", {}, "checkpoint")
    loaded = plugin.factory(ctx=RunContext(), directory=run_dir(config), options=options)
    newest = loaded.load_latest()
    assert newest is not None
    folder = Path(newest.location)
    count = len(list(folder.glob("rank-*.pt")))
    ranks = [torch.load(folder / f"rank-{r}.pt", weights_only=True) for r in range(count)]
    return {**newest.state, "ranks": ranks}


@pytest.fixture(scope="module")
def unstopped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The final state of an uninterrupted ``fsdp`` run with ``sharded`` checkpoints."""
    config = sharded_project(tmp_path_factory.mktemp("whole"), "fsdp")
    done = ups_train(config)
    assert done.returncode == 0, done.stderr[-3000:]
    state = final(config)
    assert state["step"] == STEPS
    return state


@pytest.mark.slow
@pytest.mark.parametrize(("rank", "step"), [(1, 7), (0, 13)])
def test_kill_9_of_an_fsdp_rank_mid_epoch_resumes_its_shards_and_ends_bitwise_equal(
    tmp_path: Path, unstopped: dict[str, Any], rank: int, step: int
) -> None:
    config = sharded_project(tmp_path, "fsdp")
    done = ups_train(config, "--max-restarts", "1", faults=f"kill@{rank}:{step}")
    assert done.returncode == 0, done.stderr[-3000:]
    saved = (step - 1) // 3 * 3
    assert [e["step"] for e in events(rank_log(config), "resumed")] == [saved]
    found = final(config)
    for key in STATE:
        assert_bitwise_equal(found[key], unstopped[key], key)


@pytest.mark.slow
def test_a_sigterm_under_fsdp_saves_the_shards_at_the_next_step_and_the_resumed_run_ends_equal(
    tmp_path: Path, unstopped: dict[str, Any]
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    config = sharded_project(
        tmp_path, "fsdp", model={"options": {"pid_dir": str(pids), "delay": 0.2}}
    )
    returncode, err = preempted(config, pids)
    assert returncode == EXIT_PREEMPTED, err[-3000:]
    stopped = events(rank_log(config), "preempted: saving and stopping")[0]["step"]
    assert 0 < stopped < STEPS and final(config)["step"] == stopped
    done = ups_train(config, "-o", "checkpoint.resume=latest")
    assert done.returncode == 0, done.stderr[-3000:]
    found = final(config)
    for key in STATE:
        assert_bitwise_equal(found[key], unstopped[key], key)


def test_ups_tune_tries_fsdp_batches_on_every_rank_together(tmp_path: Path) -> None:
    config = tiny_project(tmp_path, strategy={"name": "fsdp"})
    tuned = run_ups("tune", str(config), "--nproc", "2", "--limit", "12", timeout=180)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert tuned.stdout.strip() == "training.batch_size: 12 fits on every rank (2 processes)"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero"])
def test_a_two_rank_sharded_checkpoint_resumes_on_one_rank_and_under_ddp(
    tmp_path: Path, strategy: str
) -> None:
    """Stopped at step 5 on 2 ranks; resumed to the end on 1 rank (the sampler re-deals the
    rest of the epoch) under the same strategy, and under ``ddp``: both runs go on from the
    checkpoint's weights and optimizer state, and agree with each other."""
    ends = []
    for resumed_as in (strategy, "ddp"):
        folder = tmp_path / resumed_as
        config = sharded_project(folder, strategy)
        first = ups_train(config, "-o", "training.max_steps=5")
        assert first.returncode == 0, first.stderr[-3000:]
        again = ups_train(
            config,
            "-o",
            "checkpoint.resume=latest",
            "-o",
            f"strategy.name={resumed_as}",
            nproc=1,
        )
        assert again.returncode == 0, again.stderr[-3000:]
        assert [e["step"] for e in events(rank_log(config), "resumed")][-1:] == [5]
        state = final(config)
        assert state["step"] == STEPS
        ends.append(state)
    for key in ("model", "optimizer"):
        assert_close(ends[0][key], ends[1][key], key)


def assert_close(found: Any, expected: Any, where: str) -> None:
    """Nested states equal, tensors to 1e-6 (sharded and whole sums round alike or nearly)."""
    if isinstance(expected, dict):
        assert found.keys() == expected.keys(), where
        for key in expected:
            assert_close(found[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(found, expected, rtol=1e-6, atol=1e-6, msg=where)
    else:
        assert found == expected, where


@pytest.mark.slow
def test_ups_export_reads_an_fsdp_run_and_its_ema_without_a_process_group(
    tmp_path: Path,
) -> None:
    ema = {"ema": {"decay": 0.9}, "max_steps": 3}
    config = sharded_project(tmp_path, "fsdp", training=ema)
    done = ups_train(config)
    assert done.returncode == 0, done.stderr[-3000:]
    model = load_model(run_dir(config))
    exported = {}
    for which in ("latest", "ema"):
        out = tmp_path / f"{which}.pt"
        export = run_ups("export", str(run_dir(config)), "--weights", which, "--output", str(out))
        assert export.returncode == 0, export.stderr
        exported[which] = torch.load(out, weights_only=True)
        assert exported[which].keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert type(exported["latest"][name]) is torch.Tensor, name  # full, not a DTensor
        assert torch.equal(exported["latest"][name], tensor), name
        assert not torch.equal(exported["ema"][name], tensor), name  # an average of 3 steps


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero", "fsdp"])
def test_the_multitask_example_trains_under_a_sharded_strategy(
    tmp_path: Path, strategy: str
) -> None:
    done = run_ups(
        "train",
        str(ROOT / "examples" / "pde_multitask.yaml"),
        "--nproc",
        "2",
        "-o",
        f"strategy.name={strategy}",
        "-o",
        "training.max_steps=6",
        "-o",
        f"run.output_dir={tmp_path}",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"event": "done"' in next(tmp_path.glob("*/logs/rank0.jsonl")).read_text()
