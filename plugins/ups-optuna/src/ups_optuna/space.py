"""The ``sweep`` section of a config: what to search, what to optimise, when to prune.

```yaml
sweep:
  params:
    training.lr: {low: 1.0e-3, high: 0.3, log: true}   # floats: suggest_float
    model.options.width: {low: 4, high: 16, step: 4}   # ints: suggest_int
    training.batch_size: {choices: [8, 16]}            # suggest_categorical
  objective: {metric: loss, kind: eval, direction: minimize}
  pruner: {name: median, startup_trials: 1, warmup_steps: 0}
  folds: 1
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import attrs

from ups.core import ConfigError, at_least, structure

if TYPE_CHECKING:
    import optuna

Choice = bool | int | float | str | None


@attrs.frozen(kw_only=True)
class Param:
    """One parameter's search space: ``choices``, or a range ``low``..``high`` (integers when
    both bounds and ``step`` are integers), optionally on a log scale."""

    low: int | float | None = None
    high: int | float | None = None
    step: int | float | None = None
    """The grid of a range; ``null``: continuous (floats) or 1 (integers)."""
    log: bool = False
    """Sample the range on a log scale (``low`` must be > 0)."""
    choices: tuple[Choice, ...] | None = None

    def __attrs_post_init__(self) -> None:
        """:raises ValueError: when the space is not one Optuna can sample (``structure``
        reports it at the parameter's key path)."""
        if self.choices is not None:
            if self.low is not None or self.high is not None or self.log or self.step is not None:
                raise ValueError("give either choices or a range (low, high), not both")
            if not self.choices:
                raise ValueError("choices is empty")
            return
        if self.low is None or self.high is None:
            raise ValueError("give choices, or a range with both low and high")
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high})")
        if self.log and (self.low <= 0 or self.step is not None):
            raise ValueError("a log scale needs low > 0 and no step")

    @property
    def integer(self) -> bool:
        """Whether the range is one of integers."""
        return all(isinstance(v, int) for v in (self.low, self.high, self.step) if v is not None)

    def suggest(self, trial: optuna.Trial, key: str) -> Choice:
        """Sample this parameter for ``trial``, named ``key``."""
        if self.choices is not None:
            return trial.suggest_categorical(key, list(self.choices))
        assert self.low is not None and self.high is not None  # __attrs_post_init__ checked
        if self.integer:
            return trial.suggest_int(
                key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log
            )
        return trial.suggest_float(key, self.low, self.high, step=self.step, log=self.log)


@attrs.frozen(kw_only=True)
class Objective:
    """The metric a trial is scored by: its last value in the run's ``metrics.jsonl``."""

    metric: str = "loss"
    """A metric name of the reports: ``loss``, ``loss/TASK``, a user metric, ..."""
    kind: Literal["eval", "train"] = "eval"
    """Read from the evaluations (``eval``) or the training reports (``train``)."""
    direction: Literal["minimize", "maximize"] = "minimize"


@attrs.frozen(kw_only=True)
class Pruning:
    """Stopping unpromising trials early, from the values rank 0 reports as they train."""

    name: Literal["median", "none"] = "median"
    """``median``: stop a trial whose value is worse than the median of the finished trials'
    at the same step (Optuna's ``MedianPruner``); ``none``: never."""
    startup_trials: int = attrs.field(default=1, validator=at_least(0))
    """Finished trials before any trial is pruned."""
    warmup_steps: int = attrs.field(default=0, validator=at_least(0))
    """Steps of a trial before it may be pruned."""

    def pruner(self) -> optuna.pruners.BasePruner:
        """The Optuna pruner."""
        import optuna

        if self.name == "none":
            return optuna.pruners.NopPruner()
        return optuna.pruners.MedianPruner(
            n_startup_trials=self.startup_trials, n_warmup_steps=self.warmup_steps
        )


@attrs.frozen(kw_only=True)
class Sweep:
    """The ``sweep`` section, checked whole when built: ``ups validate`` builds it too (the
    ``sweep`` command's options, :func:`ups_optuna.plugin.ups_commands`)."""

    params: dict[str, Param]
    """``{config.key.path: Param}``: the parameters to sample into the config."""
    objective: Objective = attrs.field(factory=Objective)
    pruner: Pruning = attrs.field(factory=Pruning)
    folds: int = attrs.field(default=1, validator=at_least(1))
    """k-fold cross validation when >= 2: each trial trains ``folds`` times, fold ``i`` with
    ``data.options.fold=i`` and ``data.options.folds=k`` (and the same in ``eval.options``),
    and is scored by the mean; ``1``: one run per trial."""

    def __attrs_post_init__(self) -> None:
        if not self.params:
            raise ConfigError("sweep.params", "no parameter to search; add one, e.g. training.lr")


def parse_sweep(data: object) -> tuple[Sweep, dict[str, Param]]:
    """The ``sweep`` section and its parameters, checked.

    :raises ConfigError: naming the key path of a mistake (``sweep.params.training.lr.low``).
    """
    spec = structure(Sweep, data, "sweep")
    return spec, spec.params
