"""Rank 0 logs one W&B run per training run, in offline mode, read back from the run's
``.wandb`` file: what it holds equals the run folder's ``metrics.jsonl``.

wandb 0.31 ships no Python reader of its ``.wandb`` files any more (``wandb.sdk.internal.
datastore`` is gone; ``wandb-core`` writes them), so :func:`read_run` reads the framing, a
LevelDB log (a 7-byte file header, 32 KiB blocks of records each with a 7-byte header), and
parses each record with wandb's own protobuf schema, ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from wandb.proto import wandb_internal_pb2

from ups.core import Config, RunContext, load_config, load_plugins
from ups.core.engine import GuardStoppedError, train_rank
from ups.core.testing import (
    KILLER_MODULE,
    install_plugin,
    run_ranks,
    run_ups,
    tiny_project,
    torchrun_env,
    tracker_metrics,
)
from ups_wandb import GUARD_COLUMNS, GUARD_KEY, ID_FILE, guard_row, plugin

NO_AUTOLOAD = {"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}
BLOCK = 32768
FULL, LAST = 1, 4


def read_run(path: Path) -> list[Any]:
    """Every record of a ``.wandb`` file, as ``wandb_internal_pb2.Record``."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    found, payload, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            found.append(record)
            payload = b""
    return found


def offline_runs(run_dir: Path) -> list[Path]:
    """The ``.wandb`` files of the run folder's offline W&B runs, oldest first."""
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def history(files: list[Path]) -> dict[str, list[tuple[int, float]]]:
    """The metrics of the W&B runs' history rows: ``name`` -> ``(step, value)`` by step."""
    found: dict[str, dict[int, float]] = {}
    for path in files:
        for record in read_run(path):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {
                "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                for i in record.history.item
            }
            for key, value in row.items():
                if not key.startswith("_"):
                    found.setdefault(key, {})[row["_step"]] = value
    return {key: sorted(steps.items()) for key, steps in found.items()}


def first(files: list[Path], kind: str) -> Any:
    return next(
        getattr(r, kind) for p in files for r in read_run(p) if r.WhichOneof("record_type") == kind
    )


def as_a_trial(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The launcher's variables, and the link ``ups sweep`` sets for trial 3 of a study."""
    link = json.dumps({"study": "lr-search", "trial": 3})
    return torchrun_env(rank, world_size, port) | {"UPS_OPTUNA_TRIAL": link}


def _train(ctx: RunContext, config: Config) -> int | str:
    """The steps trained on this rank, or the error's line when the guard stopped the run."""
    registry = load_plugins(extra=[("wandb", plugin)], env=NO_AUTOLOAD)
    try:
        return train_rank(config, ctx, registry).steps
    except GuardStoppedError as error:
        return str(error)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Config:
    """One run of 4 steps on 2 ranks, reporting and evaluating every 2 steps."""
    tmp_path = tmp_path_factory.mktemp("wandb")
    (tmp_path / "run.yaml").write_text(
        f"""
        run: {{name: wb, output_dir: {tmp_path}, log_every: 2}}
        model: {{factory: "torch.nn:Linear", options: {{in_features: 4, out_features: 1}}}}
        data: {{factory: "ups.core.testing:two_task_dataset", tasks: [plus, minus]}}
        eval: {{factory: "ups.core.testing:two_task_dataset", options: {{n: 16}}, every_steps: 2}}
        training: {{batch_size: 8, grad_clip_norm: 10.0}}
        plugins: {{wandb: {{project: tests, mode: offline, tags: [pde, tiny]}}}}
        """
    )
    config = load_config(tmp_path / "run.yaml")
    # as a trial of `ups sweep` (ups-optuna) runs: its link in the environment
    assert run_ranks(_train, 2, config, env=as_a_trial) == [4, 4]  # 32 samples a rank, 8 a batch
    return config


def test_two_ranks_log_one_run_holding_exactly_metrics_jsonl(two_ranks: Config) -> None:
    files = offline_runs(two_ranks.run_dir)
    assert len(files) == 1  # rank 0 only
    want = tracker_metrics(two_ranks.run_dir)
    for key in ("train/loss/plus", "train/comm_bytes", "train/samples_per_s", "train/lr"):
        assert key in want, key
    assert {"train/grad_norm", "eval/loss/minus"} <= set(want)
    assert [step for step, _ in want["train/loss"]] == [2, 4]
    assert history(files) == want
    run = first(files, "run")
    assert run.run_id == (two_ranks.run_dir / ID_FILE).read_text().strip()
    assert (run.display_name, run.project, list(run.tags)) == ("wb", "tests", ["pde", "tiny"])
    assert run.run_group == "lr-search"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["training"]["batch_size"] == 8
    assert config["data"]["tasks"] == ["plus", "minus"]
    assert config["ups"] == {"digest": two_ranks.digest(), "sweep_trial": 3}
    summary = {
        "/".join(i.nested_key) or i.key: json.loads(i.value_json)
        for p in files
        for r in read_run(p)
        if r.WhichOneof("record_type") == "summary"
        for i in r.summary.update
    }
    assert summary["ups/steps"] == 4
    assert (files[0].parent / "files" / "report.png").stat().st_size > 0


@pytest.mark.slow  # a run on 2 ranks
@pytest.mark.parametrize(
    ("action", "faults", "steps"),
    [("skip", "3", [3]), ("rollback", "4,5", [3, 4]), ("stop", "3", [3])],
)
def test_guard_records_are_rows_of_the_table_guard_records_at_their_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, action: str, faults: str, steps: list[int]
) -> None:
    """NaNs planted on rank 1 at attempts ``faults``, reporting every step: the table is logged
    at each record's step, its rows the records of ``guard.jsonl`` by step; no report is
    dropped for them: the history is ``metrics.jsonl``'s.

    - skip: the report of step 2, which reaches the plugin after the record, is logged;
    - rollback (snapshots every 2 steps): the NaN at step 4 rolls back to step 2, and the one
      in the replay of step 3 too: its record comes after step 4's, and is logged first;
    - stop: at step 3, the run's error logs the record held, the W&B run failed (exit 1)."""
    monkeypatch.setenv("UPS_FAULTS", f"nan@1:{faults}")
    config = load_config(
        tiny_project(
            tmp_path,
            run={"log_every": 1},
            training={"epochs": 2, "guard": {"action": action, "snapshot_every": 2}},
            plugins={"wandb": {"project": "tests", "mode": "offline"}},
        )
    )
    ended = run_ranks(_train, 2, config)
    if action == "stop":  # every rank, the same line
        assert ended[0] == ended[1] and str(ended[0]).startswith("step 3: "), ended
    else:
        assert ended == [8 - len(steps)] * 2  # 4 batches a rank an epoch, one a record passed over
    files = offline_runs(config.run_dir)
    assert first(files, "exit").exit_code == (1 if action == "stop" else 0)
    found = history(files)
    # the table's reference, flattened in the history row: guard/records/path, .../_type, ...
    logged = {k: found.pop(k) for k in list(found) if k.startswith(f"{GUARD_KEY}/")}
    assert found == tracker_metrics(config.run_dir)
    assert logged[f"{GUARD_KEY}/_type"] == [(step, "table-file") for step in steps]
    *_, (_, path) = logged[f"{GUARD_KEY}/path"]
    table = json.loads((files[0].parent / "files" / path).read_text())
    lines = (config.run_dir / "guard.jsonl").read_text().splitlines()
    records = sorted(map(json.loads, lines), key=lambda record: record["step"])
    assert [record["step"] for record in records] == steps
    assert table["columns"] == list(GUARD_COLUMNS)
    assert table["data"] == [guard_row(record) for record in records]
    row = dict(zip(GUARD_COLUMNS, table["data"][0], strict=True))
    assert (row["step"], row["first batch"], row["action"]) == (3, 3, action)
    assert json.loads(row["ranks not finite"]) == [1]
    assert json.loads(row["indices"]) == [r["indices"] for r in records[0]["ranks"]]


@pytest.mark.slow  # two `ups train` processes
def test_a_killed_run_resumed_continues_its_wandb_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, "ups-killer", "killer", KILLER_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("UPS_BLOCK_PLUGINS", "tensorboard,mlflow")
    config = tiny_project(
        tmp_path,
        checkpoint={"every_steps": 2, "resume": "latest"},
        plugins={"wandb": {"project": "tests", "mode": "offline"}},
    )
    run_dir = tmp_path / "runs" / "tiny"
    monkeypatch.setenv("KILL_AT_STEP", "4")
    killed = run_ups("train", str(config), cwd=tmp_path)
    assert killed.returncode == -9, killed.stderr[-2000:]
    run_id = (run_dir / ID_FILE).read_text().strip()
    monkeypatch.setenv("KILL_AT_STEP", "0")
    resumed = run_ups("train", str(config), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    files = offline_runs(run_dir)
    assert len(files) == 2  # offline, each process writes its part of the one run
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2
    assert first(files, "run").resume  # W&B was asked to continue the run
    # wandb-core had not written the killed process's records: the continued run logs again
    # what metrics.jsonl held when it resumed
    want = tracker_metrics(run_dir)
    assert [step for step, _ in want["train/loss"]] == [2, 4, 6, 8]
    assert history(files) == want


@pytest.fixture
def silent_server() -> Iterator[str]:
    """The URL of a loopback server that accepts connections and never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        held: list[socket.socket] = []
        stop = threading.Event()

        def accept() -> None:
            server.settimeout(0.2)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    held.append(server.accept()[0])

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
        stop.set()
        thread.join()
        for connection in held:
            connection.close()


def timed_train(config: Path, cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    result = run_ups("train", str(config), cwd=cwd)
    return result, time.monotonic() - start


@pytest.mark.slow  # two `ups train` processes
def test_a_server_that_never_answers_costs_init_timeout_and_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, silent_server: str
) -> None:
    monkeypatch.setenv("WANDB_BASE_URL", silent_server)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.delenv("WANDB_ERROR_REPORTING", raising=False)
    timeout = 3.0
    plugins = {"wandb": {"mode": "online", "init_timeout_s": timeout}}
    monkeypatch.setenv("UPS_BLOCK_PLUGINS", "tensorboard,mlflow,wandb")
    off = tiny_project(tmp_path / "off", plugins=plugins)
    without, baseline = timed_train(off, tmp_path / "off")  # the same run, W&B off
    assert without.returncode == 0, without.stderr[-2000:]
    monkeypatch.setenv("UPS_BLOCK_PLUGINS", "tensorboard,mlflow")
    result, elapsed = timed_train(tiny_project(tmp_path / "on", plugins=plugins), tmp_path / "on")
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [line for line in result.stderr.splitlines() if "wandb failed" in line]
    assert len(warnings) == 1, result.stderr[-3000:]
    # the error and its cause on one line, whole
    error = json.loads(warnings[0])["error"]
    assert "Timed out initializing run" in error and "context deadline exceeded" in error
    lines = (tmp_path / "on/runs/tiny/metrics.jsonl").read_text().splitlines()
    trained = [json.loads(line) for line in lines]
    assert [r["step"] for r in trained if r["kind"] == "train"] == [2, 4, 6, 8]
    # W&B's wait bounded by init_timeout_s (a margin for a loaded machine), exit included
    assert elapsed - baseline < timeout + 5, (elapsed, baseline)


def test_ups_validate_checks_the_section(tmp_path: Path) -> None:
    config = tiny_project(tmp_path, plugins={"wandb": {"mode": "cloud"}})
    result = run_ups("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert "ups: error: plugins.wandb.mode: 'cloud'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_the_installed_entry_point_is_found() -> None:
    registry = load_plugins(env={})
    assert any(p.name == "wandb" and p.status == "enabled" for p in registry.plugins)
    assert "wandb" in registry.records("section")
