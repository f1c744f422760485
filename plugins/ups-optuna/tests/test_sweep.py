"""``ups sweep``: real small sweeps, every trial on 2 gloo ranks on CPU, its study in SQLite."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
import yaml
from torch.utils.data import TensorDataset

from ups.core import UsageError, load_config, load_plugins
from ups.core.testing import events, install_plugin, run_ups, wait_for
from ups_optuna import link, sweep
from ups_optuna.link import PRUNED_AT
from ups_optuna.sweep import LauncherRunner, runner

COMPLETE, PRUNED, FAIL, RUNNING, WAITING = (
    optuna.trial.TrialState.COMPLETE,
    optuna.trial.TrialState.PRUNED,
    optuna.trial.TrialState.FAIL,
    optuna.trial.TrialState.RUNNING,
    optuna.trial.TrialState.WAITING,
)


def make_data(
    n: int = 64, fold: int | None = None, folds: int | None = None, held_out: bool = False
) -> TensorDataset:
    """y = sum(x); with ``folds``, fold ``fold`` held out (the evaluation) or left out (training)."""
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    if folds is not None:
        keep = (torch.arange(n) % folds == fold) == held_out
        x = x[keep]
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def held_data(hold: list[int], folder: str, **options: Any) -> TensorDataset:
    """:func:`make_data`, except in the trials numbered in ``hold``: there each rank leaves a
    file ``folder/trial-N-rank-R`` and waits, until the test stops the sweep."""
    trial = link.current()
    if trial is not None and trial.trial in hold:
        Path(folder, f"trial-{trial.trial}-rank-{os.environ['RANK']}").touch()
        time.sleep(300)
    return make_data(**options)


def project(tmp_path: Path, sweep: dict[str, Any], **sections: Any) -> Path:
    """A config of 2 ranks x 4 steps (64 samples, batches of 8), evaluated every 2 steps."""
    config: dict[str, Any] = {
        "run": {"name": "sw", "output_dir": str(tmp_path / "runs"), "log_every": 2},
        "model": {"factory": "torch.nn:Linear", "options": {"in_features": 4, "out_features": 1}},
        "data": {"factory": f"{__file__}:make_data"},
        "eval": {"factory": f"{__file__}:make_data", "every_steps": 2},
        "training": {"batch_size": 8, "optimizer": "sgd"},
        "distributed": {"nproc": 2},
        "sweep": sweep,
        **sections,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def evals(run_dir: Path) -> dict[int, float]:
    """The evaluation losses of a run by step, from its metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "eval"}


def load(tmp_path: Path, name: str = "sw") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/runs/{name}/study.db")


SPACE = {
    "training.lr": {"low": 1.0e-3, "high": 0.3, "log": True},
    "training.batch_size": {"choices": [8, 16]},
    "eval.batch_size": {"low": 4, "high": 8, "step": 4},
}


def test_three_trials_are_scored_from_their_metrics_and_the_best_config_written(
    tmp_path: Path,
) -> None:
    config = project(tmp_path, {"params": SPACE, "pruner": {"name": "none"}})
    result = run_ups("sweep", str(config), "--trials", "3", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    study = load(tmp_path)
    trials = study.get_trials(states=(COMPLETE,))
    assert [t.number for t in trials] == [0, 1, 2]
    for trial in trials:
        losses = evals(tmp_path / "runs" / "sw" / f"trial-{trial.number}")
        assert trial.value == losses[max(losses)]  # the objective: the last evaluation's loss
        assert trial.intermediate_values == losses  # reported by rank 0 as it trained
        assert isinstance(trial.params["eval.batch_size"], int)
    best = min(trials, key=lambda t: t.value or 0.0)
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"best trial: {best.number} ")
    best_config = load_config(tmp_path / "runs" / "sw" / "best.yaml")
    assert best_config.training.lr == best.params["training.lr"]
    assert best_config.training.batch_size == best.params["training.batch_size"]
    assert best_config.run.name == "best"
    history = tmp_path / "runs" / "sw" / "history.png"
    assert history.read_bytes().startswith(b"\x89PNG")


def start_sweep(tmp_path: Path, *args: str, log: str) -> subprocess.Popen[bytes]:
    """``ups sweep ARGS`` started in a session of its own (its ranks in its process group),
    working in ``tmp_path``, its output in ``tmp_path/LOG``."""
    with (tmp_path / log).open("wb") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "ups.core", "sweep", *args],
            cwd=tmp_path,
            env=os.environ | {"UPS_LOG_FORMAT": "json"},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_held(process: subprocess.Popen[bytes], held: Path, trial: int, log: Path) -> None:
    """Wait until both ranks of ``trial`` are held in :func:`held_data`."""
    wait_for(
        lambda: all((held / f"trial-{trial}-rank-{rank}").exists() for rank in (0, 1)),
        240,
        f"trial {trial} to start",
        process=process,
        details=lambda: log.read_text()[-3000:],
    )
    # the sweep and its ranks, seen where assert_nothing_left_in looks
    assert {process.pid} < set(processes_in(held.parent))
    assert len(processes_in(held.parent)) >= 3


def processes_in(folder: Path) -> list[int]:
    """The live processes working in ``folder`` or below (a sweep's ranks work where it does)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cwd = (proc / "cwd").readlink() if proc.name.isdigit() else None
        except OSError:  # gone, or a zombie
            continue
        if cwd is not None and (cwd == folder or folder in cwd.parents):
            found.append(int(proc.name))
    return found


def assert_nothing_left_in(folder: Path) -> None:
    def left() -> list[tuple[int, bytes]]:
        return [(proc, Path(f"/proc/{proc}/cmdline").read_bytes()) for proc in processes_in(folder)]

    # the killed ranks reaped, multiprocessing's tracker ended
    wait_for(lambda: not processes_in(folder), 10, "no process left", details=lambda: str(left()))


INTERRUPTED = (
    "ups: sweep interrupted by {} during trial {}: its parameters run first when the same "
    "command resumes the sweep"
)


def last_line(log: Path) -> str:
    return log.read_text().strip().splitlines()[-1]


def test_a_sweep_killed_or_interrupted_mid_trial_runs_that_trial_again_first(
    tmp_path: Path,
) -> None:
    held = tmp_path / "held"
    held.mkdir()
    data = {"factory": f"{__file__}:held_data", "options": {"hold": [1, 2], "folder": str(held)}}
    config = project(tmp_path, {"params": SPACE, "pruner": {"name": "none"}}, data=data)
    args = (str(config), "--trials", "2")

    # Killed, with its ranks (SIGKILL to the process group), while trial 1 trains.
    killed = start_sweep(tmp_path, *args, log="killed.log")
    wait_held(killed, held, 1, tmp_path / "killed.log")
    os.killpg(killed.pid, signal.SIGKILL)
    assert killed.wait(timeout=30) == -signal.SIGKILL
    assert_nothing_left_in(tmp_path)
    assert [t.state for t in load(tmp_path).get_trials()] == [COMPLETE, RUNNING]

    # Run again: trial 1's parameters run first, as trial 2, which a Ctrl-C stops (SIGINT to
    # the sweep alone, which stops the ranks).
    interrupted = start_sweep(tmp_path, *args, log="interrupted.log")
    wait_held(interrupted, held, 2, tmp_path / "interrupted.log")
    interrupted.send_signal(signal.SIGINT)
    assert interrupted.wait(timeout=60) == 130
    assert last_line(tmp_path / "interrupted.log") == INTERRUPTED.format("SIGINT", 2)
    assert_nothing_left_in(tmp_path)
    trials = load(tmp_path).get_trials()
    assert [t.state for t in trials] == [COMPLETE, FAIL, FAIL, WAITING]
    assert trials[2].params == trials[1].params

    # Run again: trial 2's parameters (trial 1's) run first, as trial 3, and end the sweep.
    result = run_ups("sweep", *args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    trials = load(tmp_path).get_trials()
    assert [t.state for t in trials] == [COMPLETE, FAIL, FAIL, COMPLETE]
    assert trials[3].params == trials[1].params
    losses = evals(tmp_path / "runs" / "sw" / "trial-3")
    assert trials[3].value == losses[max(losses)]
    assert load_config(tmp_path / "runs" / "sw" / "best.yaml").run.name == "best"
    assert (tmp_path / "runs" / "sw" / "history.png").read_bytes().startswith(b"\x89PNG")


def test_a_trial_worse_than_the_median_is_pruned_on_every_rank_at_one_step(
    tmp_path: Path,
) -> None:
    config = project(
        tmp_path,
        {
            "params": {"training.lr": {"low": 1.0e-6, "high": 0.3, "log": True}},
            "pruner": {"name": "median", "startup_trials": 1},
        },
    )
    (tmp_path / "runs" / "sw").mkdir(parents=True)
    study = optuna.create_study(study_name="sw", storage=f"sqlite:///{tmp_path}/runs/sw/study.db")
    study.enqueue_trial({"training.lr": 0.2})
    study.enqueue_trial({"training.lr": 1.0e-6})  # hardly moves: worse at the first evaluation
    result = run_ups("sweep", str(config), "--trials", "2", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = load(tmp_path).get_trials()
    assert (first.state, second.state) == (COMPLETE, PRUNED)
    assert second.user_attrs[PRUNED_AT] == 2
    # Every rank stopped at step 2, right after the evaluation that was reported (a rank going
    # on alone would have hung the job, and logged its step-2 report after step 3).
    logs = tmp_path / "runs" / "sw" / "trial-1" / "logs"
    for rank in (0, 1):
        stepped = [e for e in events(logs / f"rank{rank}.jsonl") if "step" in e]
        assert [(e["event"], e["step"]) for e in stepped] == [("eval", 2)]
        assert second.intermediate_values == {2: pytest.approx(stepped[0]["val_loss"], rel=1e-5)}


def test_k_fold_trains_each_trial_once_per_fold_and_scores_the_mean(tmp_path: Path) -> None:
    config = project(
        tmp_path,
        {"params": {"training.lr": {"low": 0.01, "high": 0.3, "log": True}}, "folds": 2},
        data={"factory": f"{__file__}:make_data", "options": {"n": 128}},
        eval={"factory": f"{__file__}:make_data", "options": {"n": 128, "held_out": True}},
    )
    result = run_ups("sweep", str(config), "--trials", "2", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for trial in load(tmp_path).get_trials():
        folds = []
        for fold in (0, 1):
            run_dir = tmp_path / "runs" / "sw" / f"trial-{trial.number}-fold-{fold}"
            resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
            assert resolved["data"]["options"] == {"n": 128, "fold": fold, "folds": 2}
            assert resolved["eval"]["options"] == {
                "n": 128,
                "held_out": True,
                "fold": fold,
                "folds": 2,
            }
            losses = evals(run_dir)
            folds.append(losses[max(losses)])
        assert trial.value == pytest.approx(sum(folds) / 2)
        assert trial.intermediate_values == pytest.approx({0: folds[0], 1: sum(folds) / 2})


LAUNCHERS = '''
"""Two launchers: inline runs a job to its end inside submit, and writes down every request;
stuck's submit lasts until the test has signalled the sweep, then its job runs for ever and
cannot be cancelled."""
import json
import os
import subprocess
import sys
from pathlib import Path

from ups.core import LauncherPlugin, hookimpl
from ups.core.testing import wait_for


class Inline:
    def __init__(self):
        self.codes = {}

    def submit(self, request):
        with open(os.environ["INLINE_REQUESTS"], "a") as file:
            file.write(json.dumps([request.nproc_per_node, list(request.overrides)]) + "\\n")
        overrides = [arg for item in request.overrides for arg in ("-o", item)]
        command = [sys.executable, "-m", "ups.core", "train", str(request.config)]
        command += ["--nproc", str(request.nproc_per_node), *overrides]
        handle = str(len(self.codes))
        self.codes[handle] = subprocess.run(command, check=False).returncode
        return handle

    def status(self, handle):
        return "SUCCEEDED" if self.codes[handle] == 0 else "FAILED"


class Stuck:
    def submit(self, request):
        Path(os.environ["STUCK_SUBMITTING"]).touch()
        signalled = Path(os.environ["STUCK_SIGNALLED"])
        wait_for(signalled.exists, 60, f"the test to write {signalled}")
        return "job-7"

    def status(self, handle):
        return "RUNNING"

    def cancel(self, handle):
        raise RuntimeError(f"the API is down; {handle} still runs")


@hookimpl
def ups_launchers():
    return [
        LauncherPlugin(name="inline", factory=lambda options: Inline()),
        LauncherPlugin(name="stuck", factory=lambda options: Stuck()),
    ]
'''


@pytest.fixture
def test_launchers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """:data:`LAUNCHERS` installed, for the ``ups`` processes the test starts."""
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, "ups-test-launchers", "ups_test_launchers", LAUNCHERS)
    monkeypatch.setenv("PYTHONPATH", str(site))


@pytest.mark.usefixtures("test_launchers")
def test_trials_run_through_a_launcher_plugin_into_the_study_and_storage_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INLINE_REQUESTS", str(tmp_path / "requests.jsonl"))
    space = {"training.lr": {"low": 0.01, "high": 0.3}}
    config = project(tmp_path, {"params": space, "objective": {"kind": "train"}})
    storage = f"sqlite:///{tmp_path / 'sweeps.db'}"
    result = run_ups(
        "sweep",
        *(str(config), "--trials", "1", "--launcher", "inline"),
        *("--study", "lr-search", "--storage", storage),
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    requests = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert [json.loads(r) for r in requests] == [[2, ["run.name=trial-0"]]]
    # the study in that file, under that name; its files in run.output_dir/STUDY
    assert optuna.get_all_study_names(storage) == ["lr-search"]
    (trial,) = optuna.load_study(study_name="lr-search", storage=storage).get_trials()
    folder = tmp_path / "runs" / "lr-search"
    assert sorted(p.name for p in folder.iterdir()) == [
        "best.yaml",
        "history.png",
        "trial-0",
        "trial-0.yaml",
    ]
    lines = (folder / "trial-0" / "metrics.jsonl").read_text().splitlines()
    losses = {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}
    # scored by the training loss: its last report, every report passed on by rank 0 (the
    # launcher's processes inherit the sweep's environment)
    assert (trial.state, trial.value) == (COMPLETE, losses[4])
    assert trial.intermediate_values == losses


def test_a_trial_interrupted_through_a_launcher_has_its_job_cancelled(tmp_path: Path) -> None:
    held = tmp_path / "held"
    held.mkdir()
    data = {"factory": f"{__file__}:held_data", "options": {"hold": [0], "folder": str(held)}}
    config = project(tmp_path, {"params": SPACE, "pruner": {"name": "none"}}, data=data)
    # ups-cloud's local launcher: torchrun, detached in a session of its own
    args = (str(config), "--trials", "1", "--launcher", "local")
    interrupted = start_sweep(tmp_path, *args, log="sweep.log")
    wait_held(interrupted, held, 0, tmp_path / "sweep.log")
    interrupted.send_signal(signal.SIGINT)  # to the sweep alone: the job is not in its group
    assert interrupted.wait(timeout=60) == 130
    assert last_line(tmp_path / "sweep.log") == INTERRUPTED.format("SIGINT", 0)
    job = str((tmp_path / "runs" / "sw" / "trial-0").resolve())  # the local launcher's handle
    logged = events((tmp_path / "sweep.log").read_text())
    assert any(
        (e["event"], e.get("launcher"), e.get("job"))
        == ("interrupted trial's job cancelled", "local", job)
        for e in logged
    )
    assert_nothing_left_in(tmp_path)
    launcher = runner("local")
    assert isinstance(launcher, LauncherRunner)
    assert launcher.launcher.status(job) == "CANCELLED"
    assert [t.state for t in load(tmp_path).get_trials()] == [FAIL, WAITING]


@pytest.mark.usefixtures("test_launchers")
def test_a_job_the_launcher_cannot_cancel_is_named_in_the_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    submitting, signalled = tmp_path / "submitting", tmp_path / "signalled"
    monkeypatch.setenv("STUCK_SUBMITTING", str(submitting))
    monkeypatch.setenv("STUCK_SIGNALLED", str(signalled))
    config = project(tmp_path, {"params": SPACE})
    stopped = start_sweep(tmp_path, str(config), "--trials", "1", "--launcher", "stuck", log="log")
    wait_for(
        submitting.exists,
        60,
        "the job to be submitted",
        process=stopped,
        details=lambda: last_line(tmp_path / "log"),
    )
    # while the job is being submitted: the sweep waits for its handle, to cancel it
    stopped.send_signal(signal.SIGTERM)
    signalled.touch()  # the submit returns the handle once the signal is sent
    assert stopped.wait(timeout=60) == 128 + signal.SIGTERM
    assert last_line(tmp_path / "log") == INTERRUPTED.format("SIGTERM", 0) + (
        "; its job may still be running: cancel it through launcher 'stuck' (job job-7; "
        "cancel failed: RuntimeError: the API is down; job-7 still runs)"
    )
    assert [t.state for t in load(tmp_path).get_trials()] == [FAIL, WAITING]


def test_a_failed_trial_stops_the_sweep_in_one_line_naming_its_run_folder(
    tmp_path: Path,
) -> None:
    space = {"training.optimizer": {"choices": ["no_such_optimizer"]}}
    config = project(tmp_path, {"params": space})
    result = run_ups("sweep", str(config), "--trials", "2", cwd=tmp_path)
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"ups: error: trial 0 ({tmp_path / 'runs' / 'sw' / 'trial-0'}): ")
    # the first rank to fail, its error in one line
    assert "rank 0 failed: ConfigError: training.optimizer: unknown 'no_such_optimizer'" in line
    assert [t.state for t in load(tmp_path).get_trials()] == [FAIL]


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_ups("sweep", str(project(tmp_path, {"params": SPACE})), "--trials", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "ups: error: --trials must be >= 1, not 0"
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("sweep_section", "launcher", "message"),
    [
        (
            {"params": {"training.lrr": {"low": 0.1, "high": 0.2}}},
            None,
            "training.lrr: unknown key; allowed: ",
        ),
        (
            {"params": {"training.lr": {"low": 0.3, "high": 0.2}}},
            None,
            "sweep.params.training.lr: low (0.3) is above high (0.2)",
        ),
        (
            {"params": {"training.lr": {"low": 0.0, "high": 0.2, "log": True}}},
            None,
            "sweep.params.training.lr: a log scale needs low > 0 and no step",
        ),
        (
            {"params": SPACE, "objective": {"kind": "val"}},
            None,
            "sweep.objective.kind: 'val' is not one of eval, train",
        ),
        ({"params": SPACE}, "nope", "--launcher: unknown launcher 'nope'"),
    ],
)
def test_a_mistake_is_a_usage_error_naming_its_key_before_any_trial(
    tmp_path: Path, sweep_section: dict[str, Any], launcher: str | None, message: str
) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        sweep(project(tmp_path, sweep_section), trials=1, launcher=launcher)
    assert not (tmp_path / "runs" / "sw" / "study.db").exists()


def test_the_sweep_command_is_registered() -> None:
    assert load_plugins(env={}).records("command")["sweep"].plugin == "optuna"


def test_ups_validate_checks_a_config_with_a_sweep_section(tmp_path: Path) -> None:
    good = project(tmp_path, {"params": SPACE})
    result = run_ups("validate", str(good), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"{good}: ok"
    (tmp_path / "bad").mkdir()
    bad = project(tmp_path / "bad", {"params": {"training.lr": {"low": 0.3, "high": 0.2}}})
    result = run_ups("validate", str(bad), "-o", "sweep.folds=2", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"ups: error: {bad}: sweep.params.training.lr: low (0.3) is above high (0.2)"
    )
    result = run_ups("validate", str(good), "-o", "sweep.folds=0", cwd=tmp_path)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .endswith("sweep.folds: 0 is not allowed: must be >= 1")
    )


def test_ups_sweep_applies_its_overrides_to_every_trial(tmp_path: Path) -> None:
    space = {"training.lr": {"low": 1.0e-3, "high": 0.3, "log": True}}
    config = project(tmp_path, {"params": space, "pruner": {"name": "none"}})
    overrides = ["-o", "training.epochs=2", "-o", "distributed.nproc=1"]
    result = run_ups(
        "sweep",
        str(config),
        "--trials",
        "2",
        *overrides,
        "-o",
        "sweep.objective.kind=train",
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "runs" / "sw"
    for name in ("trial-0", "trial-1", "best"):
        trial = load_config(folder / f"{name}.yaml")
        assert (trial.training.epochs, trial.distributed.nproc) == (2, 1)
    lines = (folder / "trial-0" / "metrics.jsonl").read_text().splitlines()
    # one process, 64 samples in batches of 8, two epochs: 16 steps
    assert max(json.loads(line)["step"] for line in lines) == 16
    # the objective read from the training reports, as the override of the sweep section says
    assert [t.state for t in load(tmp_path).get_trials()] == [COMPLETE, COMPLETE]


def test_an_override_of_a_sampled_key_is_one_line_naming_both(tmp_path: Path) -> None:
    config = project(tmp_path, {"params": SPACE})
    result = run_ups("sweep", str(config), "--trials", "1", "-o", "training.lr=0.1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "ups: error: -o training.lr=0.1: the sweep samples training.lr "
        "(sweep.params.training.lr), which would replace this value in every trial; drop the "
        "override or the parameter"
    )
    assert not (tmp_path / "runs" / "sw" / "study.db").exists()


@pytest.mark.parametrize("command", ["train", "launch"])
def test_a_run_refuses_the_sweep_section_naming_ups_sweep(tmp_path: Path, command: str) -> None:
    config = project(tmp_path, {"params": SPACE})
    result = run_ups(command, str(config), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"ups: error: {config}: sweep: is read by `ups sweep`, not by a run: "
        f"`ups sweep {config}` trains the configs it makes of this one"
    )
