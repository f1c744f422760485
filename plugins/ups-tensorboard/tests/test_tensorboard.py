"""Rank 0 writes one TensorBoard run per training run; read back from its event files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ups.core import Config, RunContext, load_config, load_plugins
from ups.core.engine import GuardStoppedError, train_rank
from ups.core.testing import run_ranks, run_ups, tiny_project, tracker_metrics
from ups_tensorboard import plugin, record_markdown, tag

NO_AUTOLOAD = {"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}


def _train(ctx: RunContext, config: Config) -> int | str:
    """The steps trained on this rank, or the error's line when the guard stopped the run."""
    registry = load_plugins(extra=[("tensorboard", plugin)], env=NO_AUTOLOAD)
    try:
        return train_rank(config, ctx, registry).steps
    except GuardStoppedError as error:
        return str(error)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run of 4 steps on 2 ranks, reporting and evaluating every 2 steps."""
    tmp_path = tmp_path_factory.mktemp("tb")
    (tmp_path / "run.yaml").write_text(
        f"""
        run: {{name: tb, output_dir: {tmp_path}, log_every: 2}}
        model: {{factory: "torch.nn:Linear", options: {{in_features: 4, out_features: 1}}}}
        data: {{factory: "ups.core.testing:two_task_dataset", tasks: [plus, minus]}}
        eval: {{factory: "ups.core.testing:two_task_dataset", options: {{n: 16}}, every_steps: 2}}
        training: {{batch_size: 8}}
        """
    )
    config = load_config(tmp_path / "run.yaml")
    assert run_ranks(_train, 2, config) == [4, 4]  # 64 samples, 32 a rank, batches of 8
    return config.run_dir


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        name: [(e.step, e.value) for e in events.Scalars(name)] for name in events.Tags()["scalars"]
    }


def test_rank_0_writes_one_run(run_dir: Path) -> None:
    files = list((run_dir / "tensorboard").iterdir())
    assert len(files) == 1
    assert files[0].name.startswith("events.out.tfevents.")


def test_every_report_per_task_with_bytes_and_throughput(run_dir: Path) -> None:
    found = scalars(run_dir / "tensorboard")
    reports = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in reports if r["kind"] == "train"]
    evals = [r for r in reports if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [2, 4]
    for name in ("loss", "loss/plus", "loss/minus", "comm_bytes", "allreduce_bytes"):
        assert found[tag("train", name)] == [
            (r["step"], pytest.approx(r[name], rel=1e-6)) for r in train
        ], name
    assert tag("train", "loss/plus") == "train/loss/plus"
    assert tag("train", "comm_bytes") == "comm/comm_bytes"
    # a Linear(4, 1) in float32: 5 gradients of 4 bytes all-reduced per step
    assert [value for _, value in found["comm/allreduce_bytes"]] == [20.0, 20.0]
    assert all(value > 0 for _, value in found["throughput/samples_per_s"])
    assert found["eval/loss/minus"] == [
        (r["step"], pytest.approx(r["loss/minus"], rel=1e-6)) for r in evals
    ]


def texts(folder: Path, name: str) -> list[tuple[int, str]]:
    """The text ``name`` at each step, as TensorBoard reads it back."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return [
        (e.step, e.tensor_proto.string_val[0].decode())
        for e in events.Tensors(f"{name}/text_summary")
    ]


@pytest.mark.slow  # three runs on 2 ranks
@pytest.mark.parametrize(("action", "attempt"), [("skip", 1), ("rollback", 3), ("stop", 1)])
def test_a_guard_record_is_the_text_guard_at_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, action: str, attempt: int
) -> None:
    """The NaN planted on rank 1 at ``attempt``: its record (``guard.jsonl``) as Markdown, the
    text ``guard`` at its step: a skip at step 1, held until the first report (step 2) opens
    the event file; a rollback at step 3, before the replay from step 2; a stop at step 1,
    before any report: the run's error opens the file for it."""
    monkeypatch.setenv("UPS_FAULTS", f"nan@1:{attempt}")
    guard = {"action": action, "snapshot_every": 2}
    config = load_config(tiny_project(tmp_path, training={"epochs": 2, "guard": guard}))
    reason = "the gradient norm is nan (not finite)"
    if action == "stop":
        reason += " (training.guard.action: stop)"
    ended = run_ranks(_train, 2, config)
    if action == "stop":  # every rank, the same line
        assert ended[0] == ended[1] and ended[0].startswith(f"step {attempt}: {reason}; "), ended
        assert "\n" not in ended[0]
    else:
        assert all(isinstance(steps, int) for steps in ended), ended
    lines = (config.run_dir / "guard.jsonl").read_text().splitlines()
    (record,) = map(json.loads, lines)
    assert (record["action"], record["step"]) == (action, attempt)
    found = texts(config.run_dir / "tensorboard", "guard")
    assert found == [(attempt, record_markdown(record))]
    shown = found[0][1]
    assert shown.startswith(f"**step {attempt}** ({action}): {reason};")
    assert "| 1 | False |" in shown and ", ".join(map(str, record["ranks"][1]["indices"])) in shown


def test_the_installed_entry_point_is_found() -> None:
    registry = load_plugins(env={})
    assert any(p.name == "tensorboard" and p.status == "enabled" for p in registry.plugins)


@pytest.mark.slow  # an `ups train` process, restarted by its agent
def test_a_run_killed_after_reporting_past_its_checkpoint_shows_each_step_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UPS_BLOCK_PLUGINS", "mlflow,wandb")
    # rank 0 dies in step 8, after the checkpoint of step 4 and the report of step 6; the
    # agent restarts both ranks, which resume from step 4 and report step 6 again
    monkeypatch.setenv("UPS_FAULTS", "kill@0:8")
    config = tiny_project(tmp_path, training={"epochs": 3}, checkpoint={"every_steps": 4})
    done = run_ups("train", str(config), "--nproc=2", "--max-restarts=1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny"
    assert len(list((run_dir / "tensorboard").iterdir())) == 2  # one event file an attempt
    found = scalars(run_dir / "tensorboard")
    assert [step for step, _ in found["train/loss"]] == [2, 4, 6, 8, 10, 12]
    expected = [value for _, value in tracker_metrics(run_dir)["train/loss"]]
    # the resumed attempt's values (as float32: TensorBoard's)
    assert [value for _, value in found["train/loss"]] == pytest.approx(expected, rel=1e-6)
