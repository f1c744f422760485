"""``ups sweep``: sample a config's ``sweep.params`` into it, train each trial through a
launcher, score it from its run's metrics, keep the study in Optuna's RDB storage (SQLite by
default) so that an interrupted sweep resumes, and write the best config and a plot.

Files, under ``STUDY_DIR = run.output_dir/STUDY``:

- ``study.db``: the study (the default storage);
- ``trial-N.yaml``: trial N's config (resolved, the sweep section removed);
- ``trial-N/`` (or ``trial-N-fold-I/``): its run folder, with ``metrics.jsonl``;
- ``best.yaml``: the best trial's config, ``run.name: best``;
- ``history.png``: the optimisation history.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import attrs
import matplotlib
import optuna
import structlog
import yaml
from matplotlib import pyplot
from matplotlib.figure import Figure
from sqlalchemy.engine import make_url
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from ups.core import (
    TERMINAL,
    Config,
    ConfigError,
    Launcher,
    LaunchRequest,
    UsageError,
    config_from_mapping,
    load_plugins,
    rank_failures,
    read_config,
    train,
)

from . import link
from .space import Objective, Param, Sweep, parse_sweep

log = structlog.get_logger()
matplotlib.use("Agg")  # files only, never a window

RUNNING = optuna.trial.TrialState.RUNNING
FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


class TrialFailedError(Exception):
    """A trial's job failed (not pruned): the sweep stops, naming the trial's run folder."""


class JobLeftRunningError(SignalException):
    """A signal stopped a trial run through a launcher, and the launcher could not cancel the
    trial's job: it may still be running (and, on a cloud, billing)."""

    def __init__(self, sigval: signal.Signals, *, launcher: str, handle: str, reason: str) -> None:
        super().__init__(
            f"its job may still be running: cancel it through launcher {launcher!r} "
            f"(job {handle}; cancel failed: {reason})",
            sigval=sigval,
        )


class SweepInterruptedError(Exception):
    """A signal stopped the sweep while a trial ran (Ctrl-C, or a signal torchrun's agent
    raises on: SIGTERM, SIGINT, SIGHUP, SIGQUIT): the trial's ranks were stopped (through a
    launcher: its job cancelled, or the message says it may still run), the trial failed and
    its parameters queued to run first when the sweep resumes."""

    def __init__(self, message: str, signum: signal.Signals) -> None:
        super().__init__(message)
        self.signum = signum


@attrs.frozen(kw_only=True)
class SweepResult:
    """What ``ups sweep`` leaves: the best trial and where its config and the plot went."""

    best_trial: int
    best_value: float
    best_params: dict[str, Any]
    best_config: Path
    history: Path


class Runner(Protocol):
    """Trains one config on ``nproc`` processes per machine and returns once it ended."""

    def __call__(
        self, config: Path, *, nproc: int, overrides: Sequence[str], run_dir: Path
    ) -> None:
        """:raises Exception: when the job did not succeed."""
        ...


def torchrun(config: Path, *, nproc: int, overrides: Sequence[str], run_dir: Path) -> None:
    """The default runner: ``nproc`` local processes under torchrun's elastic agent (the run
    goes to the config's ``run.output_dir``, which is ``run_dir``)."""
    train(config, nproc=nproc, overrides=overrides)


@attrs.frozen
class LauncherRunner:
    """A runner through a launcher plugin: submit, then follow the job until it ends; a stop
    signal (:data:`STOP_SIGNALS`) cancels the job, then goes on as :class:`SignalException`."""

    name: str
    launcher: Launcher
    poll_s: float = 1.0

    def __call__(
        self, config: Path, *, nproc: int, overrides: Sequence[str], run_dir: Path
    ) -> None:
        request = LaunchRequest(
            config=config, nproc_per_node=nproc, overrides=tuple(overrides), run_dir=run_dir
        )
        with _stop_signals() as arm:
            handle = self.launcher.submit(request)
            try:
                arm()
                while (state := self.launcher.status(handle)) not in TERMINAL:
                    time.sleep(self.poll_s)
            except SignalException as stop:
                self._cancel(handle, stop.sigval)
                raise
        if state != "SUCCEEDED":
            raise TrialFailedError(f"launcher {self.name!r}: job {handle} {state}")

    def _cancel(self, handle: str, sigval: signal.Signals) -> None:
        """Cancel the job of a trial a signal stopped (a second signal stops the cancel).

        :raises JobLeftRunningError: when the launcher could not cancel it.
        """
        log.info("cancelling the interrupted trial's job", launcher=self.name, job=handle)
        try:
            self.launcher.cancel(handle)
        except Exception as error:
            reason = " ".join(f"{type(error).__name__}: {error}".split())
            raise JobLeftRunningError(
                sigval, launcher=self.name, handle=handle, reason=reason
            ) from error
        log.info("interrupted trial's job cancelled", launcher=self.name, job=handle)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""The signals that stop a sweep mid-trial (those torchrun's agent raises on)."""


@contextmanager
def _stop_signals() -> Iterator[Callable[[], None]]:
    """Inside, each of :data:`STOP_SIGNALS` raises :class:`SignalException`, as it does under
    torchrun's agent, once the function given is called; that call raises the first one that
    came before it: a signal while a job is being submitted waits for the job's handle, so that
    the job can be cancelled."""
    came: list[signal.Signals] = []
    armed = False

    def stop(signum: int, _frame: object) -> None:
        came.append(signal.Signals(signum))
        if armed:
            raise SignalException(f"ups sweep got {came[-1].name}", sigval=came[-1])

    def arm() -> None:
        nonlocal armed
        armed = True
        if came:
            raise SignalException(f"ups sweep got {came[0].name}", sigval=came[0])

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield arm
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def runner(name: str | None) -> Runner:
    """torchrun here, or the launcher plugin ``name`` with its default options."""
    if name is None:
        return torchrun
    try:
        record, options = load_plugins().select("launcher", name, {}, "launch")
    except ConfigError as error:
        raise UsageError(f"--launcher: {error.problem}") from None
    return LauncherRunner(name, record.factory(options=options))


def objective_value(run_dir: Path, objective: Objective) -> float:
    """The objective's last value in ``run_dir/metrics.jsonl`` (as ``ups report`` reads it).

    :raises TrialFailedError: when the run recorded no such value.
    """
    path = run_dir / "metrics.jsonl"
    values = []
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("kind") == objective.kind and record.get(objective.metric) is not None:
                values.append(float(record[objective.metric]))
    if not values:
        raise TrialFailedError(f"{path}: no {objective.kind} value of {objective.metric!r}")
    return values[-1]


def _reason(error: Exception) -> str:
    """Why a trial's job failed, in one line: the first rank's error for torchrun's."""
    if isinstance(error, ChildFailedError):
        rank, message = rank_failures(error)[0]
        return f"rank {rank} failed: {message}"
    return " ".join(f"{type(error).__name__}: {error}".split())


def _set(data: dict[str, Any], key: str, value: object) -> dict[str, Any]:
    """A copy of ``data`` with ``value`` at the dotted ``key`` (sections made as needed)."""
    head, _, rest = key.partition(".")
    copy = dict(data)
    if not rest:
        copy[head] = value
        return copy
    section = copy.get(head) or {}
    if not isinstance(section, dict):
        raise ConfigError(key, f"{head!r} is not a section")
    copy[head] = _set(section, rest, value)
    return copy


@attrs.frozen(kw_only=True)
class Search:
    """One sweep: the config without its sweep section, the search, where its files go."""

    source: Path
    base: dict[str, Any]
    spec: Sweep
    params: dict[str, Param]
    folder: Path
    nproc: int
    run: Runner

    def config(self, name: str, values: Mapping[str, object]) -> Config:
        """The config of run ``name`` with ``values`` sampled into it, checked.

        :raises ConfigError: naming the key path of a parameter the config cannot take.
        """
        data = _set(_set(self.base, "run.output_dir", str(self.folder)), "run.name", name)
        for key, value in values.items():
            data = _set(data, key, value)
        return config_from_mapping(data, base_dir=self.source.resolve().parent)

    def write(self, name: str, values: Mapping[str, object]) -> Path:
        """Write :meth:`config` as ``folder/NAME.yaml``; return its path."""
        path = self.folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(attrs.asdict(self.config(name, values)), sort_keys=False))
        return path

    def train_once(self, config: Path, run_name: str, overrides: Sequence[str]) -> float:
        """The single-trial function: train ``config`` once and return its objective."""
        self.run(
            config,
            nproc=self.nproc,
            overrides=[*overrides, f"run.name={run_name}"],
            run_dir=self.folder,
        )
        return objective_value(self.folder / run_name, self.spec.objective)

    def evaluate(self, study: optuna.Study, trial: optuna.Trial, storage: str) -> float:
        """Sample, write and train ``trial`` (once per fold); return its objective.

        :raises optuna.TrialPruned: when the pruner stopped it.
        """
        values = {key: param.suggest(trial, key) for key, param in self.params.items()}
        name = f"trial-{trial.number}"
        config = self.write(name, values)
        log.info("trial", number=trial.number, **values)
        if self.spec.folds == 1:
            ranks = link.TrialLink(
                storage=storage,
                study=study.study_name,
                trial=trial.number,
                objective=self.spec.objective,
                pruner=self.spec.pruner,
            )
            with _environ(ranks.env()):
                try:
                    return self.train_once(config, name, ())
                except SignalException:  # the sweep was interrupted, not the trial's job
                    raise
                except Exception as error:
                    ended = study.get_trials(deepcopy=False)
                    step = next(t for t in ended if t.number == trial.number).user_attrs.get(
                        link.PRUNED_AT
                    )
                    if step is None:
                        raise TrialFailedError(
                            f"trial {trial.number} ({self.folder / name}): {_reason(error)}"
                        ) from error
                    raise optuna.TrialPruned(f"at step {step}") from None
        scores = []
        for fold in range(self.spec.folds):
            scores.append(self.train_once(config, f"{name}-fold-{fold}", self._fold(fold)))
            trial.report(sum(scores) / len(scores), fold)
            if trial.should_prune():
                raise optuna.TrialPruned(f"after fold {fold}")
        return sum(scores) / len(scores)

    def _fold(self, fold: int) -> list[str]:
        sections = ["data"] + (["eval"] if self.base.get("eval") else [])
        return [
            f"{section}.options.{key}={value}"
            for section in sections
            for key, value in (("fold", fold), ("folds", self.spec.folds))
        ]


@contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set, for the processes started inside."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _read(path: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """The config file with ``overrides`` applied, which must have a sweep section, and no
    override of a key the sweep samples (the sample would replace it).

    :raises UsageError: naming the file, or the override and the parameter.
    """
    data = read_config(path, overrides)
    if "sweep" not in data:
        raise UsageError(f"{path}: no sweep section; add sweep: {{params: {{training.lr: ...}}}}")
    params = data["sweep"].get("params") if isinstance(data["sweep"], dict) else None
    for override in overrides:
        key = override.partition("=")[0]
        if isinstance(params, dict) and key in params:
            raise UsageError(
                f"-o {override}: the sweep samples {key} (sweep.params.{key}), which would "
                "replace this value in every trial; drop the override or the parameter"
            )
    return data


def _queue_again(study: optuna.Study, trial: optuna.Trial | optuna.trial.FrozenTrial) -> None:
    """Fail an interrupted trial, and queue its parameters to run again first."""
    study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
    study.enqueue_trial(trial.params, skip_if_exists=False)
    log.warning("interrupted trial queued again", number=trial.number, **trial.params)


def _resume(study: optuna.Study) -> None:
    """Trials a killed sweep left running are failed, and their parameters queued again."""
    for trial in study.get_trials(deepcopy=False, states=(RUNNING,)):
        _queue_again(study, trial)


def _plot(study: optuna.Study, path: Path) -> None:
    """The optimisation history (Optuna's matplotlib plot) into ``path``."""
    with (
        warnings.catch_warnings()
    ):  # the matplotlib backend of optuna.visualization is "experimental"
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        axes = optuna.visualization.matplotlib.plot_optimization_history(study)
    figure = axes.get_figure()  # the axes' own figure: Optuna plots on a figure of its own
    assert isinstance(figure, Figure)
    figure.savefig(path, dpi=100, bbox_inches="tight")
    pyplot.close(figure)


def sweep(
    config: Path,
    *,
    trials: int,
    study: str | None = None,
    storage: str | None = None,
    launcher: str | None = None,
    nproc: int | None = None,
    overrides: Sequence[str] = (),
) -> SweepResult:
    """Run (or resume) the sweep of ``config`` until its study holds ``trials`` finished
    trials (complete or pruned); write the best config and the history plot.

    :param overrides: ``key.path=value`` strings, as ``ups train -o`` takes, applied to the
        config file before anything else: every trial's config holds them (``sweep.*`` keys
        change the sweep section).

    :raises UsageError: a bad config or sweep section (naming the key), an unknown launcher.
    :raises TrialFailedError: a trial's job failed (the sweep stops; run it again to resume).
    :raises SweepInterruptedError: a signal stopped a trial (run the sweep again to resume).
    """
    data = _read(config, overrides)
    spec, params = parse_sweep(data.pop("sweep"))
    checked = config_from_mapping(data, base_dir=config.resolve().parent)
    if spec.objective.kind == "eval" and checked.eval is None:
        raise ConfigError("sweep.objective.kind", "'eval' needs an eval section in the config")
    name = study or checked.run.name
    folder = Path(checked.run.output_dir) / name
    folder.mkdir(parents=True, exist_ok=True)
    url = storage or f"sqlite:///{folder.resolve() / 'study.db'}"
    search = Search(
        source=config,
        base=data,
        spec=spec,
        params=params,
        folder=folder,
        nproc=nproc or checked.distributed.nproc,
        run=runner(launcher),
    )
    # Every parameter's key path checked before the first trial starts.
    search.config("check", {k: p.choices[0] if p.choices else p.low for k, p in params.items()})
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    found = optuna.create_study(
        study_name=name,
        storage=url,
        direction=spec.objective.direction,
        sampler=optuna.samplers.TPESampler(seed=checked.run.seed),
        pruner=spec.pruner.pruner(),
        load_if_exists=True,
    )
    log.info("study", name=name, storage=make_url(url).render_as_string(hide_password=True))
    _resume(found)
    while len(found.get_trials(deepcopy=False, states=FINISHED)) < trials:
        trial = found.ask()
        try:
            value = search.evaluate(found, trial, url)
        except optuna.TrialPruned as pruned:
            found.tell(trial, state=optuna.trial.TrialState.PRUNED)
            log.info("trial pruned", number=trial.number, reason=str(pruned))
            continue
        except (KeyboardInterrupt, SignalException) as stop:
            _queue_again(found, trial)
            sig = signal.SIGINT if isinstance(stop, KeyboardInterrupt) else stop.sigval
            left = f"; {stop}" if isinstance(stop, JobLeftRunningError) else ""
            raise SweepInterruptedError(
                f"sweep interrupted by {sig.name} during trial {trial.number}: its parameters "
                f"run first when the same command resumes the sweep{left}",
                sig,
            ) from None
        except BaseException:
            found.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        if not math.isfinite(value):
            found.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise TrialFailedError(f"trial {trial.number}: objective {value}")
        found.tell(trial, value)
        log.info("trial done", number=trial.number, value=value)
    best = found.best_trial
    assert best.value is not None
    best_config = search.write("best", best.params)
    history = folder / "history.png"
    _plot(found, history)
    return SweepResult(
        best_trial=best.number,
        best_value=best.value,
        best_params=dict(best.params),
        best_config=best_config,
        history=history,
    )
