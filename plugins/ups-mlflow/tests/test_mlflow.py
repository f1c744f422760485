"""Rank 0 logs one MLflow run per training run, into a local SQLite tracking store, read back
through ``MlflowClient``: what it holds equals the run folder's ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlflow import MlflowClient
from mlflow.entities import Run

from ups.core import Config, RunContext, load_config, load_plugins
from ups.core.engine import GuardStoppedError, train_rank
from ups.core.testing import (
    KILLER_MODULE,
    free_port,
    install_plugin,
    run_ranks,
    run_ups,
    tiny_project,
    torchrun_env,
    tracker_metrics,
)
from ups_mlflow import ID_FILE, plugin
from ups_mlflow.plugin import resumed_params

pytestmark = pytest.mark.filterwarnings(
    # MLflow's SQL store, reading runs back with SQLAlchemy 2.1
    "ignore:The ``noload`` loader strategy is deprecated"
)

NO_AUTOLOAD = {"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}


def as_a_trial(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The launcher's variables, and the link ``ups sweep`` sets for trial 3 of a study."""
    link = json.dumps({"study": "lr-search", "trial": 3})
    return torchrun_env(rank, world_size, port) | {"UPS_OPTUNA_TRIAL": link}


def _train(ctx: RunContext, config: Config) -> int | str:
    """The steps trained on this rank, or the error's line when the guard stopped the run."""
    registry = load_plugins(extra=[("mlflow", plugin)], env=NO_AUTOLOAD)
    try:
        return train_rank(config, ctx, registry).steps
    except GuardStoppedError as error:
        return str(error)


def logged(client: MlflowClient, run: Run) -> dict[str, list[tuple[int, float]]]:
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
    }


def the_run(client: MlflowClient, experiment: str) -> Run:
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    runs = client.search_runs([experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> MlflowClient:
    """One SQLite tracking store for the module's tests (creating one takes seconds)."""
    return MlflowClient(f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db")


def experiment(store: MlflowClient, tmp_path: Path) -> str:
    """A new experiment named after ``tmp_path``, its artifacts kept there."""
    store.create_experiment(tmp_path.name, artifact_location=str(tmp_path / "artifacts"))
    return tmp_path.name


@pytest.fixture(scope="module")
def two_ranks(
    store: MlflowClient, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Config, MlflowClient, str]:
    """One run of 4 steps on 2 ranks, reporting and evaluating every 2 steps."""
    tmp_path = tmp_path_factory.mktemp("mlflow")
    name = experiment(store, tmp_path)
    (tmp_path / "run.yaml").write_text(
        f"""
        run: {{name: mf, output_dir: {tmp_path}, log_every: 2}}
        model: {{factory: "torch.nn:Linear", options: {{in_features: 4, out_features: 1}}}}
        data: {{factory: "ups.core.testing:two_task_dataset", tasks: [plus, minus]}}
        eval: {{factory: "ups.core.testing:two_task_dataset", options: {{n: 16}}, every_steps: 2}}
        training: {{batch_size: 8, grad_clip_norm: 10.0}}
        plugins: {{mlflow: {{tracking_uri: "{store.tracking_uri}", experiment: {name},
                            tags: {{team: pde}}}}}}
        """
    )
    config = load_config(tmp_path / "run.yaml")
    # as a trial of `ups sweep` (ups-optuna) runs: its link in the environment
    assert run_ranks(_train, 2, config, env=as_a_trial) == [4, 4]  # 32 samples a rank, 8 a batch
    return config, store, name


def test_two_ranks_log_one_run_holding_exactly_metrics_jsonl(
    two_ranks: tuple[Config, MlflowClient, str],
) -> None:
    config, client, name = two_ranks
    run = the_run(client, name)  # rank 0 only: one run
    want = tracker_metrics(config.run_dir)
    for key in ("train/loss/plus", "train/comm_bytes", "train/samples_per_s", "train/lr"):
        assert key in want, key
    assert {"train/grad_norm", "eval/loss/minus"} <= set(want)
    assert [step for step, _ in want["train/loss"]] == [2, 4]
    assert logged(client, run) == want
    assert run.info.run_name == "mf"
    assert run.info.status == "FINISHED"
    assert run.data.tags["team"] == "pde"
    assert run.data.tags["ups.digest"] == config.digest()
    assert run.data.tags["ups.steps"] == "4"
    assert run.data.tags["ups.sweep.study"] == "lr-search"
    assert run.data.tags["ups.sweep.trial"] == "3"
    params = run.data.params
    assert json.loads(params["training.batch_size"]) == 8
    assert json.loads(params["data.tasks"]) == ["plus", "minus"]
    assert json.loads(params["plugins.mlflow.experiment"]) == name
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"report.png", "summary.txt"}
    assert json.loads((config.run_dir / ID_FILE).read_text())["run_id"] == run.info.run_id


@pytest.mark.slow  # two `ups train` processes
def test_a_killed_run_resumed_continues_its_mlflow_run(
    store: MlflowClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, "ups-killer", "killer", KILLER_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("UPS_BLOCK_PLUGINS", "tensorboard,wandb")
    name = experiment(store, tmp_path)
    config = tiny_project(
        tmp_path,
        checkpoint={"every_steps": 2, "resume": "latest"},
        plugins={"mlflow": {"tracking_uri": store.tracking_uri, "experiment": name}},
    )
    run_dir = tmp_path / "runs" / "tiny"
    monkeypatch.setenv("KILL_AT_STEP", "4")
    killed = run_ups("train", str(config), cwd=tmp_path)
    assert killed.returncode == -9, killed.stderr[-2000:]
    first = json.loads((run_dir / ID_FILE).read_text())["run_id"]
    monkeypatch.setenv("KILL_AT_STEP", "0")
    resumed = run_ups("train", str(config), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    run = the_run(store, name)
    assert run.info.run_id == first
    assert run.info.status == "FINISHED"
    want = tracker_metrics(run_dir)
    # the killed run reported steps 2 and 4, the resumed one (from step 4) steps 6 and 8
    assert [step for step, _ in want["train/loss"]] == [2, 4, 6, 8]
    assert logged(store, run) == want


@pytest.mark.slow  # an `ups train --nproc 2` process
def test_a_run_killed_after_reporting_past_its_checkpoint_holds_each_step_once(
    store: MlflowClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UPS_BLOCK_PLUGINS", "tensorboard,wandb")
    # rank 0 dies in step 8, after the checkpoint of step 4 and the report of step 6; the
    # agent restarts both ranks, which resume from step 4 and report step 6 again
    monkeypatch.setenv("UPS_FAULTS", "kill@0:8")
    name = experiment(store, tmp_path)
    config = tiny_project(
        tmp_path,
        training={"epochs": 3},
        checkpoint={"every_steps": 4},
        plugins={"mlflow": {"tracking_uri": store.tracking_uri, "experiment": name}},
    )
    done = run_ups("train", str(config), "--nproc=2", "--max-restarts=1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = the_run(store, name)  # the killed attempt's MLflow run deleted
    run_dir = tmp_path / "runs" / "tiny"
    history = logged(store, run)
    assert [step for step, _ in history["train/loss"]] == [2, 4, 6, 8, 10, 12]
    assert history == tracker_metrics(run_dir)
    assert run.info.status == "FINISHED"
    assert json.loads((run_dir / ID_FILE).read_text())["run_id"] == run.info.run_id
    replaced = [line for line in done.stderr.splitlines() if "held steps after step 4" in line]
    assert len(replaced) == 1, done.stderr[-3000:]


@pytest.mark.slow  # an `ups train` process
def test_a_dead_tracking_server_costs_one_warning_and_no_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UPS_BLOCK_PLUGINS", "tensorboard,wandb")
    dead = f"http://127.0.0.1:{free_port()}"
    config = tiny_project(tmp_path, plugins={"mlflow": {"tracking_uri": dead}})
    result = run_ups("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [line for line in result.stderr.splitlines() if "mlflow failed" in line]
    assert len(warnings) == 1, result.stderr[-3000:]
    assert dead in warnings[0]
    # one line, the cause at its end kept however long the error before it
    assert json.loads(warnings[0])["error"].endswith("Connection refused"), warnings[0]
    lines = (tmp_path / "runs/tiny/metrics.jsonl").read_text().splitlines()
    trained = [json.loads(line) for line in lines]
    assert [r["step"] for r in trained if r["kind"] == "train"] == [2, 4, 6, 8]


@pytest.mark.slow  # a run on 2 ranks
@pytest.mark.parametrize("action", ["skip", "rollback", "stop"])
def test_every_guard_record_so_far_is_the_runs_artifact_guard_jsonl(
    store: MlflowClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    """NaNs planted on rank 1 at attempts 3 and 5, skipped or rolled back from (snapshots
    every 2 steps): the artifact ``guard.jsonl`` holds both records, as the run folder's does,
    read back from the store; stopped at the first: its record, the run failed."""
    monkeypatch.setenv("UPS_FAULTS", "nan@1:3,5")
    name = experiment(store, tmp_path)
    config = load_config(
        tiny_project(
            tmp_path,
            training={"epochs": 2, "guard": {"action": action, "snapshot_every": 2}},
            plugins={"mlflow": {"tracking_uri": store.tracking_uri, "experiment": name}},
        )
    )
    ended = run_ranks(_train, 2, config)
    run = the_run(store, name)
    artifacts = {a.path for a in store.list_artifacts(run.info.run_id)}
    if action == "stop":  # every rank, the same line; the run's end never came
        assert ended[0] == ended[1] and str(ended[0]).startswith("step 3: "), ended
        assert (run.info.status, artifacts) == ("FAILED", {"guard.jsonl"})
        steps = [3]
    else:
        assert ended == [6, 6]
        assert run.info.status == "FINISHED"
        assert artifacts == {"guard.jsonl", "report.png", "summary.txt"}
        steps = [3, 4]
    logged = Path(store.download_artifacts(run.info.run_id, "guard.jsonl", str(tmp_path)))
    records = [json.loads(line) for line in logged.read_text().splitlines()]
    assert [(r["step"], r["action"]) for r in records] == [(step, action) for step in steps]
    assert logged.read_text() == (config.run_dir / "guard.jsonl").read_text()
    assert [r["finite"] for r in records[0]["ranks"]] == [True, False]


def test_ups_validate_checks_the_section(tmp_path: Path) -> None:
    config = tiny_project(tmp_path, plugins={"mlflow": {"experiment": 3}})
    result = run_ups("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert "ups: error: plugins.mlflow.experiment: expected a string, got 3" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_installed_entry_point_is_found() -> None:
    registry = load_plugins(env={})
    assert any(p.name == "mlflow" and p.status == "enabled" for p in registry.plugins)
    assert "mlflow" in registry.records("section")


KEYS = st.sampled_from(["training.lr", "training.epochs", "run.seed", "new.key"])


@given(
    st.dictionaries(KEYS, st.sampled_from(["1", "2", "3"])),
    st.lists(
        st.tuples(st.integers(0, 3), st.dictionaries(KEYS, st.sampled_from(["1", "2", "3"]))),
        max_size=5,
    ),
)
def test_params_changed_on_resume_are_logged_under_new_keys_only(
    first: dict[str, str], resumes: list[tuple[int, dict[str, str]]]
) -> None:
    """Each resume (at any step, the same one twice too) logs what differs from the run's
    latest values under keys never logged before, and then nothing more for the same config."""
    logged = dict(first)
    for step, values in resumes:
        current = first | values
        changed = resumed_params(logged, current, step)
        assert not set(changed) & set(logged)  # MLflow refuses to change a param
        logged |= changed
        assert resumed_params(logged, current, step) == {}
        for key, value in current.items():
            newest = [k for k in changed if k == key or k.endswith(f".{key}")]
            assert [changed[k] for k in newest] in ([], [value])


def the_only_run(uri: str, experiment: str) -> Run:
    return the_run(MlflowClient(uri), experiment)


@pytest.mark.slow  # three `ups train` processes
def test_a_resumed_run_logs_its_changed_params_and_says_when_its_store_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UPS_BLOCK_PLUGINS", "tensorboard,wandb")
    first, second = (f"sqlite:///{tmp_path}/{name}/mlflow.db" for name in ("a", "b"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    work = tmp_path / "work"
    config = tiny_project(
        work,
        checkpoint={"every_steps": 4, "resume": "latest"},
        plugins={"mlflow": {"tracking_uri": first, "experiment": "pde"}},
    )
    done = run_ups("train", str(config), cwd=work)
    assert done.returncode == 0, done.stderr[-2000:]
    run = the_only_run(first, "pde")
    # the experiment the plugin created keeps its artifacts beside the store, not in ./mlruns
    assert {a.path for a in MlflowClient(first).list_artifacts(run.info.run_id)} == {
        "report.png",
        "summary.txt",
    }
    assert (tmp_path / "a" / "mlartifacts").is_dir()
    assert not (work / "mlruns").exists()

    changed = ["-o", "training.epochs=2", "-o", "training.lr=0.1"]
    resumed = run_ups("train", str(config), *changed, cwd=work)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    again = the_only_run(first, "pde")
    assert again.info.run_id == run.info.run_id  # continued
    params = again.data.params
    assert json.loads(params["training.lr"]) == 0.05  # MLflow keeps the first value
    assert json.loads(params["resumed_1_at_8.training.lr"]) == 0.1
    assert json.loads(params["resumed_1_at_8.training.epochs"]) == 2
    assert not any(key.startswith("resumed_1_at_8.run.") for key in params)
    assert again.data.tags["ups.digest"] == load_config(config, changed[1::2]).digest()

    moved = [*changed, "-o", "training.epochs=3", "-o", f"plugins.mlflow.tracking_uri={second}"]
    result = run_ups("train", str(config), *moved, cwd=work)
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [json.loads(line) for line in result.stderr.splitlines() if first in line]
    assert [w["level"] for w in warnings] == ["warning"], result.stderr[-3000:]
    assert second in warnings[0]["event"] and run.info.run_id in warnings[0]["event"]
    new = the_only_run(second, "pde")
    assert [step for step, _ in logged(MlflowClient(second), new)["train/loss"]] == [18, 20, 22, 24]
    assert the_only_run(first, "pde").info.run_id == run.info.run_id  # left as it was
