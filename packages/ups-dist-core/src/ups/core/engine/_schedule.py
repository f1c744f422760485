"""A schedule of training operations, decided on rank 0 and applied by every rank in the same step.

A schedule is an ordered list of rules. Each rule has a trigger (``when``: the validation loss
fell below a threshold, a step was reached, or an evaluated value stopped improving) and actions
(``do``: multiply the learning rate, change the per-rank batch size or the accumulation steps,
save now, stop)::

    schedule:
      - {when: {val_loss_below: 0.05, at_latest_step: 2000}, do: {batch_size: 64, lr_multiplier: 2.0}}
      - {when: {at_latest_step: 5000}, do: {stop: true}}
      - {when: {plateau: {patience: 5}}, do: {stop: true}}

The rules with a loss or step trigger are stages: each fires at most once, and in order. Such a
rule is only considered once every stage before it has fired; it then fires at the first check
where its trigger holds. Several stages can fire at the same check: the first, and each next one
whose trigger holds too. A plateau rule is no stage: it is armed from the start, whatever the
stages' position, fires when its value has not improved for ``patience`` evaluations, and then
again after ``patience`` more with ``repeat: true``.

Seed 000's bug was a schedule that rank 0 alone evaluated and acted on, so the ranks diverged.
Here every rank holds a :class:`Schedule` and calls :meth:`Schedule.decide` at the same steps;
rank 0 evaluates the rules with its own view, the resulting :class:`Decision` is broadcast with
:func:`ups.core.decide`, and every rank updates its schedule from that decision (never from its
own evaluation) and applies it. See ``docs/decisions.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs
import structlog

from ..config._errors import ConfigError, UsageError, did_you_mean
from ..config._structure import above, at_least

if TYPE_CHECKING:  # the rules are read with the config, which imports no torch
    import torch

    from ..dist._context import RunContext

__all__ = [
    "MULTIPLIER_KEY",
    "Action",
    "Decision",
    "Fired",
    "Plateau",
    "Reason",
    "Rule",
    "Schedule",
    "Trigger",
    "Watch",
    "agreed_value",
    "apply_lr_multiplier",
    "has_action",
    "has_trigger",
    "monitored",
    "schedule_warnings",
]

log = structlog.get_logger()

Reason = Literal["val_loss_below", "at_latest_step", "plateau"]

MULTIPLIER_KEY = "ups_lr_multiplier"
"""The param-group key where :func:`apply_lr_multiplier` keeps the multiplier applied."""

STATE_VERSION = 2
"""Version 2 added the plateau rules' watches; version 1 states (without them) load too."""


def _flow(instance: attrs.AttrsInstance) -> str:
    """The fields of an attrs instance that differ from their defaults, as a YAML flow mapping."""
    items = []
    for field in attrs.fields(type(instance)):
        value = getattr(instance, field.name)
        if value != field.default:
            shown = ("true" if value else "false") if isinstance(value, bool) else value
            items.append(f"{field.name}: {shown}")
    return "{" + ", ".join(items) + "}"


@attrs.frozen(repr=False)
class has_trigger:  # noqa: N801 - a validator reads like a phrase
    """Validator: a rule's ``when`` sets ``val_loss_below``, ``at_latest_step`` or both, or
    ``plateau`` alone."""

    def __call__(self, _inst: object, _attr: attrs.Attribute[Any], value: Trigger) -> None:
        staged = value.val_loss_below is not None or value.at_latest_step is not None
        if value.plateau is not None and staged:
            raise ValueError(
                "plateau goes alone (a plateau rule is armed from the start, outside the "
                "stages); set plateau, or val_loss_below, at_latest_step or both"
            )
        if value.plateau is None and not staged:
            raise ValueError("set val_loss_below, at_latest_step or both, or plateau")

    def __repr__(self) -> str:
        return "has_trigger()"


@attrs.frozen(repr=False)
class has_action:  # noqa: N801
    """Validator: a rule's ``do`` does something."""

    def __call__(self, _inst: object, _attr: attrs.Attribute[Any], value: Action) -> None:
        if not value.actions():
            raise ValueError(
                "does nothing; set lr_multiplier, batch_size, accumulation_steps, "
                "stop: true or save: true"
            )

    def __repr__(self) -> str:
        return "has_action()"


@attrs.frozen(kw_only=True)
class Plateau:
    """A plateau trigger (``when: {plateau: {...}}``): an evaluated value that stopped improving.

    At each evaluation during training the value improves when it is below the best so far by
    more than ``min_delta`` (``mode: max``: above it); the first value is an improvement. The
    rule fires when ``patience`` evaluations in a row brought none.
    """

    monitor: str = "val_loss"
    """The evaluated value watched, named as the ``eval`` log event names it: ``val_loss``,
    ``val_loss/<task>`` or ``val_<metric>``."""
    patience: int = attrs.field(default=3, validator=at_least(1))
    """Evaluations in a row without improvement that fire the rule."""
    min_delta: float = attrs.field(default=0.0, validator=at_least(0))
    """How much better than the best so far a value must be to count as an improvement."""
    mode: Literal["min", "max"] = "min"
    """``min``: lower is better (a loss); ``max``: higher is better (an accuracy)."""
    repeat: bool = False
    """Fire again after each further ``patience`` evaluations without improvement (the count
    restarts at each firing, the best so far is kept); ``false``: fire once."""

    def __str__(self) -> str:
        return _flow(self)

    def improves(self, value: float, best: float | None) -> bool:
        """Whether ``value`` improves on ``best`` (``None``: nothing seen yet); NaN never does."""
        if math.isnan(value):
            return False
        if best is None:
            return True
        if self.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta


@attrs.frozen
class Watch:
    """Where a plateau rule stands: the best value so far and the evaluations since it."""

    best: float | None = None
    bad: int = 0


@attrs.frozen(kw_only=True)
class Trigger:
    """When a rule fires (the ``when`` of a rule). With both keys set, whichever comes first."""

    val_loss_below: float | None = None
    """Fire at the first evaluation whose validation loss is below this (strictly)."""
    at_latest_step: int | None = attrs.field(default=None, validator=at_least(1))
    """Fire once this many optimizer steps are done, if the rule has not fired before: a step
    timeout for ``val_loss_below``, or on its own a rule for a fixed step. A rule waiting for
    earlier rules fires as soon as they have (at the same check), even when this step is past."""
    plateau: Plateau | None = None
    """Fire when an evaluated value stopped improving; alone in its ``when``."""

    def __str__(self) -> str:
        return _flow(self)


@attrs.frozen(kw_only=True)
class Action:
    """What a rule does (the ``do`` of a rule); any combination, at least one."""

    lr_multiplier: float | None = attrs.field(default=None, validator=above(0))
    """Multiply the learning rate by this. Multipliers of successive rules compose: 2 then 0.5
    gives the configured LR again."""
    batch_size: int | None = attrs.field(default=None, validator=at_least(1))
    """The new per-rank batch size."""
    accumulation_steps: int | None = attrs.field(default=None, validator=at_least(1))
    """The new number of batches accumulated per optimizer step."""
    stop: bool = False
    """End training after this step."""
    save: bool = False
    """Save a checkpoint at this step."""

    def actions(self) -> dict[str, Any]:
        """The actions this sets, by key (``stop``/``save`` only when true)."""
        return {
            field.name: getattr(self, field.name)
            for field in attrs.fields(Action)
            if getattr(self, field.name) is not None and getattr(self, field.name) is not False
        }

    def __str__(self) -> str:
        return _flow(self)


@attrs.frozen(kw_only=True)
class Rule:
    """One rule of a schedule: ``{when: {...}, do: {...}}``."""

    when: Trigger = attrs.field(validator=has_trigger())
    do: Action = attrs.field(validator=has_action())


def schedule_warnings(
    rules: Sequence[Rule], *, max_steps: int | None = None, path: str = "schedule"
) -> list[str]:
    """Rules that are valid but probably not what the user meant, as messages naming key paths.

    For ``validate()``: a step timeout earlier than an earlier stage's (stages fire in order, so
    it cannot fire before that one), a stage after a stage's ``stop`` (it can only fire at the
    same check), and a step timeout beyond ``max_steps``. Plateau rules are no stages.
    """
    warnings = []
    latest: tuple[int, int] | None = None  # (rule index, its at_latest_step)
    stop: int | None = None
    for index, rule in enumerate(rules):
        if rule.when.plateau is not None:
            continue
        key = f"{path}[{index}]"
        step = rule.when.at_latest_step
        if step is not None and latest is not None and step < latest[1]:
            warnings.append(
                f"{key}.when.at_latest_step: {step} is before {path}[{latest[0]}]'s "
                f"{latest[1]}; rules fire in order, so this one fires at step {latest[1]} at the "
                "latest"
            )
        if step is not None and max_steps is not None and step > max_steps:
            warnings.append(
                f"{key}.when.at_latest_step: {step} is after training.max_steps ({max_steps})"
            )
        if stop is not None:
            warnings.append(
                f"{key}: comes after the stop of {path}[{stop}]; it fires only if its trigger "
                "holds at the same check"
            )
        if step is not None and (latest is None or step >= latest[1]):
            latest = (index, step)
        if rule.do.stop and stop is None:
            stop = index
    return warnings


@attrs.frozen(kw_only=True)
class Fired:
    """One rule that fired: which, at which step, why, and the values rank 0 saw."""

    rule: int
    """The rule's index in the schedule."""
    step: int
    reason: Reason
    """``val_loss_below`` when the loss was below the threshold (even if the timeout was also
    reached), else ``at_latest_step``."""
    val_loss: float | None
    """Rank 0's validation loss at this check; ``None`` at a check without evaluation."""
    value: float | None = None
    """For a plateau rule: rank 0's value of its ``monitor``; else ``None``."""


@attrs.frozen(kw_only=True)
class Decision:
    """What the rules that fired at one check decided; the same object on every rank.

    ``None`` fields are unchanged. When several rules fire together their effects combine in
    order: multipliers multiply, the last batch size and accumulation steps win, ``stop`` and
    ``save`` are true if any rule set them.
    """

    step: int
    fired: tuple[Fired, ...]
    lr_multiplier: float | None
    """The LR multiplier from now on, relative to the configured (base) LR: the product of every
    multiplier fired so far, not just this decision's."""
    batch_size: int | None
    """The new per-rank batch size."""
    accumulation_steps: int | None
    stop: bool
    save: bool
    watches: tuple[tuple[int, Watch], ...] = ()
    """At a check with an evaluation: each armed plateau rule's :class:`Watch` afterwards, by
    rule index (every rank adopts rank 0's)."""


def monitored(values: Mapping[str, float], name: str, key: str) -> float:
    """The value ``name`` of an evaluation's ``values`` (``val_loss``, ``val_<metric>``).

    :raises ConfigError: naming ``key`` and the values the evaluation reports, when it
        reports no ``name``.
    """
    if name not in values:
        raise ConfigError(
            key,
            f"{name!r} is not reported by the run's evaluation; it reports: "
            f"{', '.join(sorted(values))}{did_you_mean(name, values)}",
        )
    return values[name]


def agreed_value(ctx: RunContext, values: Mapping[str, float], name: str, key: str) -> float:
    """The value ``name`` of an evaluation's ``values`` as rank 0 reads it, on every rank (what a
    plateau scheduler steps with, what keep-best ranks). A collective every rank calls after
    the same evaluations.

    :raises ConfigError: on every rank, before the collective, when ``values`` has no ``name``
        (see :func:`monitored`).
    """
    monitored(values, name, key)
    from ..dist import _collectives as collectives

    return collectives.decide(ctx, lambda: float(values[name]))


def _reason(when: Trigger, step: int, val_loss: float | None) -> Reason | None:
    if when.val_loss_below is not None and val_loss is not None and val_loss < when.val_loss_below:
        return "val_loss_below"
    if when.at_latest_step is not None and step >= when.at_latest_step:
        return "at_latest_step"
    return None


class Schedule:
    """The schedule's rules and its position; one per rank, kept identical on every rank.

    The position (which rules fired, when and why, each plateau rule's watch, and the LR
    multiplier, batch size and accumulation steps in effect) changes only through
    :meth:`decide`, with the decision rank 0 broadcast, so it is the same on every rank after
    every call. It is part of the training state: save :meth:`state_dict` in checkpoints,
    restore it with :meth:`load_state_dict`.
    """

    def __init__(
        self, rules: Sequence[Rule], *, batch_size: int, accumulation_steps: int = 1
    ) -> None:
        """``batch_size`` and ``accumulation_steps`` are the configured values in effect until a
        rule changes them."""
        if batch_size < 1 or accumulation_steps < 1:
            raise ValueError("batch_size and accumulation_steps must be >= 1")
        self.rules: tuple[Rule, ...] = tuple(rules)
        self._stages = tuple(i for i, r in enumerate(self.rules) if r.when.plateau is None)
        self._fired: list[Fired] = []
        self._watches: dict[int, Watch] = {
            i: Watch() for i, r in enumerate(self.rules) if r.when.plateau is not None
        }
        self._lr_multiplier = 1.0
        self._batch_size = batch_size
        self._accumulation_steps = accumulation_steps

    def __repr__(self) -> str:
        return (
            f"Schedule(position={self.position}/{len(self._stages)}, "
            f"lr_multiplier={self._lr_multiplier}, batch_size={self._batch_size}, "
            f"accumulation_steps={self._accumulation_steps})"
        )

    @property
    def fired(self) -> tuple[Fired, ...]:
        """The rules that fired so far, in the order they fired (a repeated plateau rule once
        per firing)."""
        return tuple(self._fired)

    @property
    def position(self) -> int:
        """How many stages (the rules without a plateau trigger) fired; the next stage to
        consider is the ``position``-th."""
        return sum(1 for f in self._fired if self.rules[f.rule].when.plateau is None)

    @property
    def watches(self) -> dict[int, Watch]:
        """Each armed plateau rule's watch, by rule index (a rule without ``repeat`` is
        disarmed once it fired)."""
        return dict(self._watches)

    @property
    def done(self) -> bool:
        """Whether no rule can fire any more: every stage fired, and every plateau rule fired
        and does not repeat."""
        return self.position == len(self._stages) and not self._watches

    @property
    def stopped(self) -> bool:
        """Whether a rule with ``stop: true`` fired (a resumed run should not train further)."""
        return any(self.rules[f.rule].do.stop for f in self._fired)

    @property
    def lr_multiplier(self) -> float:
        """The LR multiplier in effect, relative to the configured LR (1.0 until a rule fires)."""
        return self._lr_multiplier

    @property
    def batch_size(self) -> int:
        """The per-rank batch size in effect."""
        return self._batch_size

    @property
    def accumulation_steps(self) -> int:
        """The accumulation steps in effect."""
        return self._accumulation_steps

    @property
    def needs_val_loss(self) -> bool:
        """Whether some rule has a ``val_loss_below`` or ``plateau`` trigger (the run must
        evaluate during training)."""
        return any(
            rule.when.val_loss_below is not None or rule.when.plateau is not None
            for rule in self.rules
        )

    def may_fire(self, step: int, *, evaluated: bool) -> bool:
        """Whether a rule could fire at this check: the gate in front of the collective.

        A pure function of ``step``, ``evaluated`` and the position, which are the same on every
        rank, so every rank takes the same branch: all enter the broadcast, or none does. It
        never looks at the values evaluated, which a rank may see differently. True when this
        check evaluated and a plateau rule is armed (its watch moves on) or the next stage has
        a loss trigger, or when the next stage's step timeout is reached.
        """
        if evaluated and self._watches:
            return True
        if self.position == len(self._stages):
            return False
        when = self.rules[self._stages[self.position]].when
        if evaluated and when.val_loss_below is not None:
            return True
        return when.at_latest_step is not None and step >= when.at_latest_step

    def evaluate(
        self,
        step: int,
        val_loss: float | None = None,
        *,
        metrics: Mapping[str, float] | None = None,
    ) -> Decision | None:
        """What the rules decide at this check, from this rank's view; changes nothing.

        Not a collective: :meth:`decide` runs it on rank 0 only. The result is a pure function
        of the position, ``step``, ``val_loss`` and ``metrics``: ``None`` when no rule fired and
        no plateau rule watched a value.
        """
        values = _values(val_loss, metrics)
        if values is not None:
            val_loss = values.get("val_loss", val_loss)
        fired: list[Fired] = []
        for stage in self._stages[self.position :]:
            reason = _reason(self.rules[stage].when, step, val_loss)
            if reason is None:
                break
            fired.append(Fired(rule=stage, step=step, reason=reason, val_loss=val_loss))
        watches: list[tuple[int, Watch]] = []
        for index, watch in self._watches.items() if values is not None else ():
            plateau = self._plateau(index)
            value = monitored(values or {}, plateau.monitor, _monitor_key(index))
            best, bad = (
                (value, 0) if plateau.improves(value, watch.best) else (watch.best, watch.bad + 1)
            )
            if bad >= plateau.patience:
                fired.append(
                    Fired(rule=index, step=step, reason="plateau", val_loss=val_loss, value=value)
                )
                bad = 0
            watches.append((index, Watch(best=best, bad=bad)))
        if not fired and not watches:
            return None
        return _combine(
            self._lr_multiplier,
            step,
            sorted(fired, key=lambda f: f.rule),
            self.rules,
            tuple(watches),
        )

    def decide(
        self,
        ctx: RunContext,
        step: int,
        val_loss: float | None = None,
        *,
        metrics: Mapping[str, float] | None = None,
    ) -> Decision | None:
        """Rank 0 evaluates the rules; every rank gets its decision and moves the schedule on.

        Call it on every rank at every optimizer step, after ``optimizer.step()``, with
        ``step`` the number of optimizer steps done; at a step that evaluated, after the
        evaluation, with ``val_loss`` the validation loss, or ``metrics`` the evaluated values
        by the names plateau rules monitor (``val_loss``, ``val_<metric>``; every rank passes
        them at the same steps; only rank 0's values count, so a rank's local or stale value
        cannot split the ranks). It is a collective only when :meth:`may_fire` says a rule
        could fire, a choice every rank makes alike; other calls cost nothing.

        Returns the decision, the same on every rank, or ``None`` when no rule fired. The
        caller applies it (``docs/decisions.md``: LR, batch size, accumulation, save, stop).
        Rank 0 logs one ``schedule rule fired`` event per rule.

        :raises ConfigError: on every rank, before any collective, when a plateau rule
            monitors a value that ``metrics`` lacks (naming those it has).
        :raises ups.core.RankFailedError: on every rank, if evaluating failed on rank 0.
        """
        values = _values(val_loss, metrics)
        if values is not None:  # the same names on every rank: all raise, or none
            for index in self._watches:
                monitored(values, self._plateau(index).monitor, _monitor_key(index))
        if not self.may_fire(step, evaluated=values is not None):
            return None
        from ..dist import _collectives as collectives

        decision = collectives.decide(ctx, lambda: self.evaluate(step, val_loss, metrics=metrics))
        if decision is None:
            return None
        self._apply(decision)
        if ctx.is_main:
            for fired in decision.fired:
                log.info(
                    "schedule rule fired",
                    step=fired.step,
                    rule=fired.rule,
                    reason=fired.reason,
                    val_loss=fired.val_loss,
                    **({"value": fired.value} if fired.reason == "plateau" else {}),
                    do=self.rules[fired.rule].do.actions(),
                    lr_multiplier=self._lr_multiplier,
                    batch_size=self._batch_size,
                    accumulation_steps=self._accumulation_steps,
                )
        return decision if decision.fired else None

    def _plateau(self, index: int) -> Plateau:
        """The plateau trigger of rule ``index``, a plateau rule."""
        plateau = self.rules[index].when.plateau
        assert plateau is not None
        return plateau

    def _apply(self, decision: Decision) -> None:
        stages = [f.rule for f in decision.fired if self.rules[f.rule].when.plateau is None]
        plateaus = [f.rule for f in decision.fired if self.rules[f.rule].when.plateau is not None]
        if stages != list(self._stages[self.position : self.position + len(stages)]) or any(
            rule not in self._watches for rule in plateaus
        ):
            raise RuntimeError(
                f"decision fires rules {[f.rule for f in decision.fired]} but the schedule is "
                f"at stage {self.position} with plateau rules {sorted(self._watches)} armed; "
                "the ranks' schedules have diverged"
            )
        self._fired.extend(decision.fired)
        self._watches.update(decision.watches)
        for rule in plateaus:
            if not self._plateau(rule).repeat:
                self._watches.pop(rule, None)
        if decision.lr_multiplier is not None:
            self._lr_multiplier = decision.lr_multiplier
        if decision.batch_size is not None:
            self._batch_size = decision.batch_size
        if decision.accumulation_steps is not None:
            self._accumulation_steps = decision.accumulation_steps

    def state_dict(self) -> dict[str, Any]:
        """The position, as plain data (loadable with ``torch.load(weights_only=True)``).

        Each fired rule and each plateau rule's watch is saved with its rule's configuration,
        so that resuming with a schedule whose fired rules were edited is caught, and a watch
        is kept only for the rule it watched for.
        """
        return {
            "version": STATE_VERSION,
            "fired": [
                {**attrs.asdict(f), "config": attrs.asdict(self.rules[f.rule])} for f in self._fired
            ],
            "watches": [
                {"rule": i, **attrs.asdict(w), "config": attrs.asdict(self.rules[i])}
                for i, w in self._watches.items()
            ],
            "lr_multiplier": self._lr_multiplier,
            "batch_size": self._batch_size,
            "accumulation_steps": self._accumulation_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position: the fired rules stay fired, the plateau rules go
        on counting, and the saved LR multiplier, batch size and accumulation steps replace
        the configured ones.

        Every rank loads the same state, so the schedules stay identical.

        :raises UsageError: when a rule that already fired is missing or differs in this
            schedule (rules not yet fired may be changed or added; a changed plateau rule
            that has not fired starts watching afresh).
        """
        if state.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"unknown schedule state version {state.get('version')!r}")
        fired = []
        for entry in state["fired"]:
            index, saved = entry["rule"], entry["config"]
            if index >= len(self.rules) or attrs.asdict(self.rules[index]) != saved:
                now = "missing" if index >= len(self.rules) else _describe(self.rules[index])
                raise UsageError(
                    f"schedule[{index}] fired at step {entry['step']} as "
                    f"{_describe(_rule_from_dict(saved))} but is now {now}; a resumed run must "
                    "keep the rules that already fired"
                )
            fired.append(
                Fired(
                    rule=index,
                    step=entry["step"],
                    reason=entry["reason"],
                    val_loss=entry["val_loss"],
                    value=entry.get("value"),
                )
            )
        stages = [f.rule for f in fired if self.rules[f.rule].when.plateau is None]
        if stages != list(self._stages[: len(stages)]):
            raise ValueError(f"schedule state fires stages {stages} out of order")
        watches = {i: Watch() for i, r in enumerate(self.rules) if r.when.plateau is not None}
        for rule in {f.rule for f in fired} & set(watches):
            if not self._plateau(rule).repeat:
                del watches[rule]
        for entry in state.get("watches", ()):
            index = entry["rule"]
            if index in watches and attrs.asdict(self.rules[index]) == entry["config"]:
                watches[index] = Watch(best=entry["best"], bad=entry["bad"])
        self._fired, self._watches = fired, watches
        self._lr_multiplier = float(state["lr_multiplier"])
        self._batch_size = int(state["batch_size"])
        self._accumulation_steps = int(state["accumulation_steps"])


def _values(
    val_loss: float | None, metrics: Mapping[str, float] | None
) -> Mapping[str, float] | None:
    """The evaluated values of a check, by name: ``metrics``, or ``val_loss`` alone; ``None``
    at a check without evaluation."""
    if metrics is not None:
        return metrics
    return None if val_loss is None else {"val_loss": val_loss}


def _monitor_key(index: int) -> str:
    return f"schedule[{index}].when.plateau.monitor"


def _combine(
    multiplier: float,
    step: int,
    fired: Sequence[Fired],
    rules: Sequence[Rule],
    watches: tuple[tuple[int, Watch], ...],
) -> Decision:
    """The decision of the rules that ``fired`` at one check, their actions combined in the
    order of the rules, from the cumulative LR ``multiplier`` in effect."""
    lr_changed = False
    batch_size: int | None = None
    accumulation: int | None = None
    stop = save = False
    for f in fired:
        do = rules[f.rule].do
        if do.lr_multiplier is not None:
            multiplier, lr_changed = multiplier * do.lr_multiplier, True
        batch_size = do.batch_size if do.batch_size is not None else batch_size
        accumulation = do.accumulation_steps if do.accumulation_steps is not None else accumulation
        stop, save = stop or do.stop, save or do.save
    return Decision(
        step=step,
        fired=tuple(fired),
        lr_multiplier=multiplier if lr_changed else None,
        batch_size=batch_size,
        accumulation_steps=accumulation,
        stop=stop,
        save=save,
        watches=watches,
    )


def _rule_from_dict(data: Mapping[str, Any]) -> Rule:
    """A :class:`Rule` from ``attrs.asdict(rule)`` (as a state dict stores it)."""
    when = dict(data["when"])
    plateau = when.pop("plateau", None)
    return Rule(
        when=Trigger(**when, plateau=None if plateau is None else Plateau(**plateau)),
        do=Action(**data["do"]),
    )


def _describe(rule: Rule) -> str:
    return f"{{when: {rule.when}, do: {rule.do}}}"


def apply_lr_multiplier(
    optimizer: torch.optim.Optimizer,
    multiplier: float,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> None:
    """Make ``multiplier`` the LR multiplier in effect on every param group of ``optimizer``.

    Pass the schedule's cumulative :attr:`Schedule.lr_multiplier` (or a decision's
    ``lr_multiplier``), never a rule's own factor. Each group remembers the multiplier applied
    to it under :data:`MULTIPLIER_KEY`, and its LR is scaled by the ratio of the new to the
    applied one, so the LR is always the un-multiplied LR times the schedule's multiplier:
    calling twice changes nothing, and 2.0 then 0.5 gives the configured LR back. The key
    travels with ``optimizer.state_dict()``, so after loading a checkpoint the call is a no-op.

    With an LR ``scheduler`` (a ``torch.optim.lr_scheduler`` class), its ``base_lrs`` are
    scaled by the same ratio, so the scheduler's later steps keep the multiplier: closed-form
    schedulers (``LambdaLR``) compute from ``base_lrs``, chainable ones (``StepLR``,
    ``LinearLR``, ``CosineAnnealingLR`` with ``eta_min=0``) from the group's current LR.
    ``eta_min`` and ``OneCycleLR``'s own LR bounds are not scaled.
    """
    import torch

    base_lrs: list[float] | None = getattr(scheduler, "base_lrs", None)
    for index, group in enumerate(optimizer.param_groups):
        ratio = multiplier / group.get(MULTIPLIER_KEY, 1.0)
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].mul_(ratio)
        else:
            group["lr"] = group["lr"] * ratio
        if base_lrs is not None:
            base_lrs[index] = base_lrs[index] * ratio
        group[MULTIPLIER_KEY] = multiplier
