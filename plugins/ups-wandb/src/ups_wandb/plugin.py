"""The ``wandb`` plugin: a logger through the lifecycle hooks, and the config section
``plugins.wandb``.

Rank 0 alone logs, into one W&B run per training run, when the config has a ``plugins.wandb``
section: the resolved config as the run's config, every training report and evaluation as
``train/NAME`` and ``eval/NAME`` at their optimizer step, the run's name and tags, and at the
end the summary (``ups/*`` keys) and the report's figure (``report.png`` among the run's
files). The W&B files go to ``RUN_DIR/wandb``; the run's id is kept in ``RUN_DIR/wandb.id``:
a run that resumes from a checkpoint continues the same W&B run. W&B's service writes what it
is handed in blocks, and a killed process loses the block it had not written: offline, a
continued run therefore first logs again what ``metrics.jsonl`` held when it resumed (online,
W&B keeps what it received and ignores steps before its last). Inside a trial of
``ups sweep`` (ups-optuna), the run's group is the study.

Each bad step the training guard records (``ups_guard_record``) adds a row to the table
``guard/records`` (every record so far), logged at the record's step. W&B drops what is logged
at a step before its last, and a report reaches the plugin one step after its own: a record
is held until the first report at or after its step (or the run's end), then logged just
before it, so no report is dropped for it.

W&B failing (no network, a bad key, a server down) never stops training: one warning (the
error and its root cause on one line), and the plugin logs nothing more for the run; the
metrics stay in ``metrics.jsonl``. A server that does not answer costs ``init_timeout_s``, no
more (see :data:`ENV_DEFAULTS`).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import os
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs
import structlog

from ups.core import (
    Config,
    SectionPlugin,
    TrainResult,
    UsageError,
    above,
    hookimpl,
    one_line,
    read_metrics,
    write_report,
)

if TYPE_CHECKING:  # ups.core.dist imports torch; every `ups` command imports this module
    from ups.core import RunContext

log = structlog.get_logger()

ID_FILE = "wandb.id"
"""In the run folder: the id of the W&B run it logs to."""
SWEEP_ENV = "UPS_OPTUNA_TRIAL"
"""Set by ``ups sweep`` (ups-optuna) for a trial's processes: its study and trial number."""
ENV_DEFAULTS = {"WANDB_ERROR_REPORTING": "false"}
"""Set unless set already: wandb's own error reports go to the run's server, and one that does
not answer held the process's exit about 12 s. With ``quiet`` (no "logged in as" line, whose
account lookup waited 10 s before ``init_timeout_s`` began), a server that does not answer
costs ``init_timeout_s``; the plugin logs the run's URL itself."""
GUARD_KEY = "guard/records"
"""The key of the table of the guard's records."""
GUARD_COLUMNS = (
    "step",
    "epoch",
    "first batch",
    "last batch",
    "action",
    "reason",
    "ranks not finite",
    "tasks",
    "indices",
)
"""The columns of :data:`GUARD_KEY`'s table, one row a record (:func:`guard_row`)."""


def guard_row(record: Mapping[str, Any]) -> list[Any]:
    """A guard record (``ups_guard_record``) as a row of :data:`GUARD_COLUMNS`: the ranks whose
    loss was not finite, each rank's tasks and sample indices as JSON text."""
    ranks = record["ranks"]
    return [
        record["step"],
        record["epoch"],
        *record["batches"],
        record["action"],
        record["reason"],
        json.dumps([r["rank"] for r in ranks if not r["finite"]]),
        json.dumps([r["tasks"] for r in ranks]),
        json.dumps([r["indices"] for r in ranks]),
    ]


@attrs.frozen(kw_only=True)
class WandbOptions:
    """The ``plugins.wandb`` section."""

    project: str = "ups"
    entity: str | None = None
    """The team or user the run goes to; ``null``: the API key's default entity."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """``offline``: files only (``wandb sync`` uploads them later); ``null``: W&B's own
    choice (``WANDB_MODE``, ``wandb offline``, else online)."""
    tags: tuple[str, ...] = ()
    group: str | None = None
    """Runs shown together; ``null``: the study's name inside a sweep's trial, else none."""
    init_timeout_s: float = attrs.field(default=30.0, validator=above(0))
    """Seconds W&B may take to start the run before the plugin gives up (a server down)."""


class WandbTracker:
    """Rank 0's W&B run for one training run; on the other ranks, and without a
    ``plugins.wandb`` section, every method does nothing. The W&B run is started at the
    first report, once it is known whether the training run resumed."""

    def __init__(self) -> None:
        self.config: Config | None = None
        """The run's config while the tracker logs (rank 0, with a ``plugins.wandb`` section)."""
        self.resumed: list[dict[str, Any]] | None = None
        """When the run resumed: the reports ``metrics.jsonl`` held then."""
        self.run: Any = None
        self.held: list[Mapping[str, Any]] = []
        """Guard records not logged yet, by step: each waits for a report at or after its step."""
        self.rows: list[list[Any]] = []
        """The rows of the guard's table logged so far."""

    def start(self, ctx: RunContext, config: Config) -> None:
        """Take a new run's config (rank 0, with a ``plugins.wandb`` section)."""
        self.config = config if ctx.is_main and "wandb" in config.plugins else None
        self.resumed, self.run, self.held, self.rows = None, None, [], []

    def resume(self) -> None:
        """The run resumes from a checkpoint: keep the reports made before, to log again."""
        if self.config is not None:
            try:
                self.resumed = read_metrics(self.config.run_dir)
            except UsageError:  # no report was made before the checkpoint
                self.resumed = []

    def metrics(
        self, kind: Literal["train", "eval"], step: int, values: Mapping[str, float]
    ) -> None:
        """Log one report's metrics as ``KIND/NAME`` at ``step``, after the guard records held
        up to ``step``; NaN (not measured) left out."""

        def log() -> None:
            self._log_guard(step)
            _log(self.run, kind, step, values)

        self._call("log metrics", log)

    def guard(self, record: Mapping[str, Any]) -> None:
        """Hold a guard record for the first report at or after its step, the records held in
        order of step: one made in a rollback's replay may come after a later step's."""
        if self.config is not None:
            bisect.insort(self.held, record, key=lambda held: held["step"])

    def end(self, result: TrainResult) -> None:
        """Log the guard records held, add the summary and the report's figure, and finish the
        W&B run."""

        def finish() -> None:
            assert self.config is not None
            self._log_guard(None)
            self.run.summary.update(
                {f"ups/{k}": v for k, v in attrs.asdict(result).items() if "metrics" not in k}
            )
            figure, _ = write_report(self.config.run_dir)
            self.run.save(str(figure), base_path=str(self.config.run_dir), policy="now")
            self.run.finish(exit_code=0)

        self._call("finish the run", finish)
        self.config = None

    def fail(self) -> None:
        """Log the guard records held (a stop's), and finish the W&B run as failed, if one is
        open or a record is held; never raises."""

        def finish() -> None:
            self._log_guard(None)
            self.run.finish(exit_code=1)

        if self.run is not None or self.held:
            self._call("finish the run", finish)
        self.config = None

    def _log_guard(self, step: int | None) -> None:
        """Log each guard record held up to ``step`` (``None``: all), by step, as the table of
        every record so far at the record's step."""
        import wandb

        while self.held and (step is None or self.held[0]["step"] <= step):
            record = self.held.pop(0)
            self.rows.append(guard_row(record))
            table = wandb.Table(columns=list(GUARD_COLUMNS), data=[list(r) for r in self.rows])
            self.run.log({GUARD_KEY: table}, step=record["step"])

    def _call(self, what: str, action: Callable[[], object]) -> None:
        """Run ``action`` against the W&B run (started first if need be); on any error, warn
        once and log nothing more."""
        if self.config is None:
            return
        try:
            if self.run is None:
                self.run = self._init(self.config)
            action()
        except Exception as error:
            log.warning(
                "wandb failed; logging no more to it, the metrics stay in metrics.jsonl",
                during=what,
                error=one_line(error),
            )
            self.config = None
            if self.run is not None:
                with contextlib.suppress(Exception):
                    self.run.finish(exit_code=1)
            self.run = None

    def _init(self, config: Config) -> Any:
        """Continue the run folder's W&B run when resuming, else start one."""
        for name, value in ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        import wandb

        options = config.section(WandbOptions, "wandb")
        id_file = config.run_dir / ID_FILE
        resumed = self.resumed is not None
        kept = id_file.read_text().strip() if resumed and id_file.is_file() else ""
        run_id = kept or uuid.uuid4().hex[:12]
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
        sweep = json.loads(os.environ[SWEEP_ENV]) if os.environ.get(SWEEP_ENV) else {}
        plain = json.loads(json.dumps(attrs.asdict(config), default=str))
        run = wandb.init(
            project=options.project,
            entity=options.entity,
            mode=options.mode,
            dir=str(config.run_dir),
            id=run_id,
            resume="allow" if kept else None,
            name=config.run.name,
            tags=list(options.tags),
            group=options.group or sweep.get("study"),
            config=plain | {"ups": {"digest": config.digest(), "sweep_trial": sweep.get("trial")}},
            settings=wandb.Settings(init_timeout=options.init_timeout_s, quiet=True),
        )
        log.info("wandb run " + ("continued" if kept else "started"), run_id=run_id, url=run.url)
        if kept and run.offline:
            for record in self.resumed or []:
                if record["kind"] in ("train", "eval"):
                    metrics = {k: v for k, v in record.items() if k not in ("kind", "step")}
                    _log(run, record["kind"], record["step"], metrics)
        return run


def _log(run: Any, kind: str, step: int, values: Mapping[str, float]) -> None:
    """Log one report as ``KIND/NAME`` at ``step``; NaN (not measured) left out."""
    run.log({f"{kind}/{name}": v for name, v in values.items() if not math.isnan(v)}, step=step)


_tracker = WandbTracker()


@hookimpl
def ups_config_sections() -> list[SectionPlugin]:
    return [
        SectionPlugin(
            name="wandb", options=WandbOptions, description="log runs to Weights & Biases (rank 0)"
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
def ups_guard_record(ctx: RunContext, record: Mapping[str, Any]) -> None:
    _tracker.guard(record)


@hookimpl
def ups_run_end(ctx: RunContext, result: TrainResult) -> None:
    _tracker.end(result)


@hookimpl
def ups_error(ctx: RunContext, error: BaseException) -> None:
    _tracker.fail()
