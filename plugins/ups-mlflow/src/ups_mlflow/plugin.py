"""The ``mlflow`` plugin: a logger through the lifecycle hooks, and the config section
``plugins.mlflow``.

Rank 0 alone logs, into one MLflow run per training run, when the config has a
``plugins.mlflow`` section: the resolved config as params (dotted keys), every training report
and evaluation as metrics ``train/NAME`` and ``eval/NAME`` at their optimizer step, the run's
name and tags, and at the end the summary (tags ``ups.*``, ``summary.txt``) and the report's
figure (``report.png``) as artifacts, and each time the training guard records a bad step
(``ups_guard_record``) the run folder's records so far (the artifact ``guard.jsonl``), into
the experiment's artifact location (for an
experiment the plugin creates: ``artifact_location``, else ``mlartifacts`` beside an SQLite
store's database). The MLflow run's id is kept in ``RUN_DIR/mlflow.json``: a run that resumes
from a checkpoint continues the same MLflow run, which then holds each step once; a param the
resumed config changed is logged again as ``resumed_N_at_STEP.KEY`` (MLflow params cannot
change), and the tag ``ups.digest`` follows the config. An MLflow run cannot forget a value, so
when the interrupted attempt logged steps after the checkpoint (which the resumed run reports
again), a new MLflow run takes the old one's history up to the checkpoint (with its
timestamps), the params and tags, and the old one is deleted (MLflow keeps deleted runs
restorable until ``mlflow gc``); one line says so. A run resumed with another
``tracking_uri`` starts a new MLflow run there, with a warning naming both stores.

MLflow failing (a bad URI, a server down) never stops training: one warning (the error and its
root cause on one line), and the plugin logs nothing more for the run; the metrics stay in
``metrics.jsonl``.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs
import structlog

from ups.core import (
    Config,
    SectionPlugin,
    TrainResult,
    UsageError,
    hookimpl,
    one_line,
    read_metrics,
    write_report,
)

if TYPE_CHECKING:  # ups.core.dist imports torch; every `ups` command imports this module
    from ups.core import RunContext

log = structlog.get_logger()

ID_FILE = "mlflow.json"
"""In the run folder: ``{"run_id": ..., "tracking_uri": ...}`` of the MLflow run it logs to."""
SWEEP_ENV = "UPS_OPTUNA_TRIAL"
"""Set by ``ups sweep`` (ups-optuna) for a trial's processes: its study and trial number."""
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""MLflow's retries of a request to a tracking server, unless set: a server down costs seconds
once, not the minutes of MLflow's own defaults (7 retries, 120 s each)."""
PARAMS_PER_CALL = 100
"""The most params MLflow takes in one ``log_batch``."""
PARAM_LENGTH = 6000
"""The longest param value MLflow stores; a longer one (a long schedule) is cut there."""
METRICS_PER_CALL = 1000
"""The most metrics MLflow takes in one ``log_batch``."""
RESUMED = re.compile(r"resumed_(\d+)_at_(\d+)\.(.+)")
"""A param the Nth resume that changed params changed, at step STEP:
``resumed_N_at_STEP.KEY``, its value from then on."""
ARTIFACTS = "mlartifacts"
"""Beside an SQLite store's database: the artifacts of the experiments the plugin creates."""
GUARD_FILE = "guard.jsonl"
"""In the run folder: the training guard's records, one bad step a line; logged as the run's
artifact of that name."""


@attrs.frozen(kw_only=True)
class MlflowOptions:
    """The ``plugins.mlflow`` section."""

    tracking_uri: str | None = None
    """Where runs go: ``sqlite:///mlflow.db``, ``http://host:5000``, ...; ``null``: MLflow's
    own default (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``)."""
    experiment: str = "ups"
    """The experiment the run goes to, created if missing."""
    tags: dict[str, Any] = attrs.field(factory=dict)
    """Tags of the run, besides ``ups.*``."""
    artifact_location: str | None = None
    """Where an experiment the plugin creates keeps its runs' artifacts (a folder, relative to
    the working directory, or a URI: ``s3://bucket/mlflow``); ``null``: ``mlartifacts`` beside
    an SQLite store's database, the server's own place for a tracking server, MLflow's default
    otherwise. An existing experiment keeps its own."""


def flatten(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The leaves of nested mappings, with dotted keys: ``training.lr``."""
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def sweep_tags(env: Mapping[str, str]) -> dict[str, str]:
    """``ups.sweep.study`` and ``ups.sweep.trial`` inside a trial of ``ups sweep``, else none."""
    if not env.get(SWEEP_ENV):
        return {}
    link = json.loads(env[SWEEP_ENV])
    return {"ups.sweep.study": str(link["study"]), "ups.sweep.trial": str(link["trial"])}


class MlflowTracker:
    """Rank 0's MLflow run for one training run; on the other ranks, and without a
    ``plugins.mlflow`` section, every method does nothing. The MLflow run is opened at the
    first report, once it is known whether the training run resumed."""

    def __init__(self) -> None:
        self.config: Config | None = None
        """The run's config while the tracker logs (rank 0, with a ``plugins.mlflow`` section)."""
        self.options = MlflowOptions()
        self.resumed_at: int | None = None
        """When the run resumed from a checkpoint: the last step ``metrics.jsonl`` kept (-1:
        none); what the MLflow run holds after it is the interrupted attempt's."""
        self.client: Any = None
        self.run_id = ""

    def start(self, ctx: RunContext, config: Config) -> None:
        """Take a new run's config (rank 0, with a ``plugins.mlflow`` section)."""
        active = ctx.is_main and "mlflow" in config.plugins
        self.config = config if active else None
        self.options = config.section(MlflowOptions, "mlflow") if active else MlflowOptions()
        self.resumed_at, self.client, self.run_id = None, None, ""

    def resume(self) -> None:
        """The run resumes from a checkpoint (``metrics.jsonl`` holds the reports up to it):
        note its last step."""
        if self.config is not None:
            try:
                self.resumed_at = max(r["step"] for r in read_metrics(self.config.run_dir))
            except UsageError:  # no report was made before the checkpoint
                self.resumed_at = -1

    def metrics(
        self, kind: Literal["train", "eval"], step: int, values: Mapping[str, float]
    ) -> None:
        """Log one report's metrics as ``KIND/NAME`` at ``step``; NaN (not measured) left out."""

        def log_batch() -> None:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            batch = [
                Metric(f"{kind}/{name}", value, now, step)
                for name, value in values.items()
                if not math.isnan(value)
            ]
            self.client.log_batch(self.run_id, metrics=batch)

        self._call("log metrics", log_batch)

    def guard(self) -> None:
        """The guard recorded a bad step: log the run folder's records so far (the one just
        written last) as the artifact ``guard.jsonl``, replacing the one logged before."""

        def log_records() -> None:
            assert self.config is not None
            self.client.log_artifact(self.run_id, str(self.config.run_dir / GUARD_FILE))

        self._call("log the guard's records", log_records)

    def end(self, result: TrainResult) -> None:
        """Log the summary and the report, and end the MLflow run."""

        def finish() -> None:
            assert self.config is not None
            for key, value in attrs.asdict(result, filter=_summary_field).items():
                self.client.set_tag(self.run_id, f"ups.{key}", str(value))
            figure, table = write_report(self.config.run_dir)
            self.client.log_artifact(self.run_id, str(figure))
            self.client.log_text(self.run_id, table, "summary.txt")
            status = "KILLED" if result.preempted else "FINISHED"
            self.client.set_terminated(self.run_id, status)

        self._call("end the run", finish)
        self.config = None

    def fail(self) -> None:
        """Mark the MLflow run failed, if one is open; never raises (the run's error goes on)."""
        if self.run_id:
            self._call("end the run", lambda: self.client.set_terminated(self.run_id, "FAILED"))
        self.config = None

    def _call(self, what: str, action: Callable[[], object]) -> None:
        """Run ``action`` against the open MLflow run (opened first if need be); on any error,
        warn once and log nothing more."""
        if self.config is None:
            return
        try:
            if not self.run_id:
                self._open(self.config)
            action()
        except Exception as error:
            log.warning(
                "mlflow failed; logging no more to it, the metrics stay in metrics.jsonl",
                during=what,
                tracking_uri=self.options.tracking_uri,
                error=one_line(error),
            )
            self.config = None

    def _open(self, config: Config) -> None:
        """Continue the run folder's MLflow run when resuming, else start one; replace it when
        it holds steps after the checkpoint (see the module doc)."""
        import mlflow

        for name, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        uri = self.options.tracking_uri or mlflow.get_tracking_uri()
        self.client = mlflow.MlflowClient(uri)
        kept = _read_id(config.run_dir / ID_FILE)
        if self.resumed_at is None or not kept:
            self._create(config, uri)
            return
        if kept.get("tracking_uri") != uri:
            log.warning(
                f"mlflow: the run resumed with tracking_uri {uri}, its MLflow run "
                f"{kept['run_id']} is in {kept.get('tracking_uri')}: a new MLflow run starts "
                f"in {uri}, from step {self.resumed_at + 1} on; the earlier steps stay in "
                f"{kept.get('tracking_uri')}",
                run_id=kept["run_id"],
            )
            self._create(config, uri)
            return
        old = kept["run_id"]
        history = [
            point
            for key in self.client.get_run(old).data.metrics
            for point in self.client.get_metric_history(old, key)
        ]
        if all(point.step <= self.resumed_at for point in history):
            self.run_id = old
            self.client.update_run(self.run_id, status="RUNNING")
            log.info("mlflow run continued", run_id=self.run_id, tracking_uri=uri)
            self._changed_params(config)
            return
        self._create(config, uri)
        history = [point for point in history if point.step <= self.resumed_at]
        for first in range(0, len(history), METRICS_PER_CALL):
            batch = history[first : first + METRICS_PER_CALL]
            self.client.log_batch(self.run_id, metrics=batch)
        self.client.delete_run(old)
        log.info(
            f"mlflow run {old} held steps after step {self.resumed_at}, which the resumed run "
            f"reports again: replaced by {self.run_id} (its history up to there copied), deleted",
            run_id=self.run_id,
            deleted=old,
        )

    def _create(self, config: Config, uri: str) -> None:
        """Start a new MLflow run, log the params, and keep its id in the run folder."""
        experiment = self.client.get_experiment_by_name(self.options.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(
                self.options.experiment,
                artifact_location=artifact_location(self.options.artifact_location, uri),
            )
        )
        tags = {str(k): str(v) for k, v in self.options.tags.items()}
        tags |= {"ups.digest": config.digest()} | sweep_tags(os.environ)
        run = self.client.create_run(experiment_id, run_name=config.run.name, tags=tags)
        self.run_id = run.info.run_id
        id_file = config.run_dir / ID_FILE
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(json.dumps({"run_id": self.run_id, "tracking_uri": uri}) + "\n")
        log.info("mlflow run started", run_id=self.run_id, tracking_uri=uri)
        self._params(config)

    def _params(self, config: Config) -> None:
        self._log_params(params(config))

    def _changed_params(self, config: Config) -> None:
        """Log the params the resumed ``config`` changed (:func:`resumed_params`), and set
        ``ups.digest`` to its digest."""
        logged = self.client.get_run(self.run_id).data.params
        changed = resumed_params(logged, params(config), max(self.resumed_at or 0, 0))
        self._log_params(changed)
        self.client.set_tag(self.run_id, "ups.digest", config.digest())
        if changed:
            log.info("mlflow params changed on resume", params=sorted(changed))

    def _log_params(self, values: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        batch = [Param(key, value) for key, value in values.items()]
        for first in range(0, len(batch), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=batch[first : first + PARAMS_PER_CALL])


def params(config: Config) -> dict[str, str]:
    """The config as MLflow params: dotted keys, JSON values (cut at :data:`PARAM_LENGTH`)."""
    plain = json.loads(json.dumps(attrs.asdict(config), default=str))
    return {key: json.dumps(value)[:PARAM_LENGTH] for key, value in flatten(plain)}


def resumed_params(
    logged: Mapping[str, str], current: Mapping[str, str], step: int
) -> dict[str, str]:
    """The params to log when a run that logged ``logged`` resumes at ``step`` with the params
    ``current``: each whose value differs from the run's latest for its key (that of the last
    resume's ``resumed_N_at_STEP.KEY``, else ``KEY``), as ``resumed_N_at_STEP.KEY`` with ``N``
    one more than the last resume's, or as ``KEY`` when the run never had it. No key logged
    before is given again: MLflow params cannot change."""
    latest = {key: value for key, value in logged.items() if not RESUMED.fullmatch(key)}
    resumed = [(m, value) for key, value in logged.items() if (m := RESUMED.fullmatch(key))]
    for found, value in sorted(resumed, key=lambda item: int(item[0][1])):
        latest[found[3]] = value
    n = 1 + max((int(found[1]) for found, _ in resumed), default=0)
    return {
        f"resumed_{n}_at_{step}.{key}" if key in latest else key: value
        for key, value in current.items()
        if latest.get(key) != value
    }


def artifact_location(option: str | None, uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: ``option`` (a relative folder made
    absolute), else ``mlartifacts`` beside the database of an SQLite store (``sqlite:///PATH``),
    else ``None``: the tracking server's or MLflow's choice."""
    if option is not None:
        return option if "://" in option else str(Path(option).resolve())
    if not uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url  # MLflow's SQL stores are SQLAlchemy's

    database = make_url(uri).database
    if not database or database == ":memory:":
        return None
    return str(Path(database).resolve().parent / ARTIFACTS)


def _summary_field(attribute: attrs.Attribute[Any], _value: object) -> bool:
    return attribute.name in ("steps", "epochs", "checkpoint", "preempted")


def _read_id(path: Path) -> dict[str, str] | None:
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) and "run_id" in kept else None


_tracker = MlflowTracker()


@hookimpl
def ups_config_sections() -> list[SectionPlugin]:
    return [
        SectionPlugin(
            name="mlflow", options=MlflowOptions, description="log runs to MLflow (rank 0)"
        )
    ]


@hookimpl
def ups_run_start(ctx: RunContext, config: Config) -> None:
    _tracker.start(ctx, config)


@hookimpl
def ups_checkpoint_restore(ctx: RunContext) -> None:
    _tracker.resume()


@hookimpl
def ups_step_end(ctx: RunContext, step: int, metrics: Mapping[str, float]) -> None:
    _tracker.metrics("train", step, metrics)


@hookimpl
def ups_eval_end(ctx: RunContext, step: int, metrics: Mapping[str, float]) -> None:
    _tracker.metrics("eval", step, metrics)


@hookimpl
def ups_guard_record(ctx: RunContext) -> None:
    _tracker.guard()


@hookimpl
def ups_run_end(ctx: RunContext, result: TrainResult) -> None:
    _tracker.end(result)


@hookimpl
def ups_error(ctx: RunContext, error: BaseException) -> None:
    _tracker.fail()
