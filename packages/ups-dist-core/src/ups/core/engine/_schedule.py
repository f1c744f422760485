"""A schedule of training operations, decided on rank 0 and applied by every rank in the same step.

A schedule is an ordered list of rules. Each rule has a trigger (``when``: the validation loss
fell below a threshold, or a step was reached) and actions (``do``: multiply the learning rate,
change the per-rank batch size or the accumulation steps, save now, stop)::

    schedule:
      - {when: {val_loss_below: 0.05, at_latest_step: 2000}, do: {batch_size: 64, lr_multiplier: 2.0}}
      - {when: {at_latest_step: 5000}, do: {stop: true}}

The rules are stages: each fires at most once, and in order. A rule is only considered once
every rule before it has fired; it then fires at the first check where its trigger holds. Several
rules can fire at the same check: the first, and each next one whose trigger holds too.

Seed 000's bug was a schedule that rank 0 alone evaluated and acted on, so the ranks diverged.
Here every rank holds a :class:`Schedule` and calls :meth:`Schedule.decide` at the same steps;
rank 0 evaluates the rules with its own view, the resulting :class:`Decision` is broadcast with
:func:`ups.core.decide`, and every rank updates its schedule from that decision (never from its
own evaluation) and applies it. See ``docs/decisions.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs
import structlog

from ..config._errors import UsageError
from ..config._structure import above, at_least

if TYPE_CHECKING:  # the rules are read with the config, which imports no torch
    import torch

    from ..dist._context import RunContext

__all__ = [
    "MULTIPLIER_KEY",
    "Action",
    "Decision",
    "Fired",
    "Reason",
    "Rule",
    "Schedule",
    "Trigger",
    "apply_lr_multiplier",
    "has_action",
    "has_trigger",
    "schedule_warnings",
]

log = structlog.get_logger()

Reason = Literal["val_loss_below", "at_latest_step"]

MULTIPLIER_KEY = "ups_lr_multiplier"
"""The param-group key where :func:`apply_lr_multiplier` keeps the multiplier applied."""

STATE_VERSION = 1


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
    """Validator: a rule's ``when`` sets ``val_loss_below``, ``at_latest_step`` or both."""

    def __call__(self, _inst: object, _attr: attrs.Attribute[Any], value: Trigger) -> None:
        if value.val_loss_below is None and value.at_latest_step is None:
            raise ValueError("set val_loss_below, at_latest_step or both")

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
class Trigger:
    """When a rule fires (the ``when`` of a rule). With both keys set, whichever comes first."""

    val_loss_below: float | None = None
    """Fire at the first evaluation whose validation loss is below this (strictly)."""
    at_latest_step: int | None = attrs.field(default=None, validator=at_least(1))
    """Fire once this many optimizer steps are done, if the rule has not fired before: a step
    timeout for ``val_loss_below``, or on its own a rule for a fixed step. A rule waiting for
    earlier rules fires as soon as they have (at the same check), even when this step is past."""

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

    For ``validate()``: a step timeout earlier than an earlier rule's (rules fire in order, so it
    cannot fire before that one), a rule after a ``stop`` (it can only fire at the same check),
    and a step timeout beyond ``max_steps``.
    """
    warnings = []
    latest: tuple[int, int] | None = None  # (rule index, its at_latest_step)
    stop: int | None = None
    for index, rule in enumerate(rules):
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
    """One rule that fired: which, at which step, why, and the validation loss rank 0 saw."""

    rule: int
    """The rule's index in the schedule."""
    step: int
    reason: Reason
    """``val_loss_below`` when the loss was below the threshold (even if the timeout was also
    reached), else ``at_latest_step``."""
    val_loss: float | None
    """Rank 0's validation loss at this check; ``None`` at a check without evaluation."""


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


def _reason(when: Trigger, step: int, val_loss: float | None) -> Reason | None:
    if when.val_loss_below is not None and val_loss is not None and val_loss < when.val_loss_below:
        return "val_loss_below"
    if when.at_latest_step is not None and step >= when.at_latest_step:
        return "at_latest_step"
    return None


class Schedule:
    """The schedule's rules and its position; one per rank, kept identical on every rank.

    The position (which rules fired, when and why, and the LR multiplier, batch size and
    accumulation steps in effect) changes only through :meth:`decide`, with the decision rank 0
    broadcast, so it is the same on every rank after every call. It is part of the training
    state: save :meth:`state_dict` in checkpoints, restore it with :meth:`load_state_dict`.
    """

    def __init__(
        self, rules: Sequence[Rule], *, batch_size: int, accumulation_steps: int = 1
    ) -> None:
        """``batch_size`` and ``accumulation_steps`` are the configured values in effect until a
        rule changes them."""
        if batch_size < 1 or accumulation_steps < 1:
            raise ValueError("batch_size and accumulation_steps must be >= 1")
        self.rules: tuple[Rule, ...] = tuple(rules)
        self._fired: list[Fired] = []
        self._lr_multiplier = 1.0
        self._batch_size = batch_size
        self._accumulation_steps = accumulation_steps

    def __repr__(self) -> str:
        return (
            f"Schedule(position={self.position}/{len(self.rules)}, "
            f"lr_multiplier={self._lr_multiplier}, batch_size={self._batch_size}, "
            f"accumulation_steps={self._accumulation_steps})"
        )

    @property
    def fired(self) -> tuple[Fired, ...]:
        """The rules that fired so far, in order."""
        return tuple(self._fired)

    @property
    def position(self) -> int:
        """How many rules fired: the index of the next rule to consider."""
        return len(self._fired)

    @property
    def done(self) -> bool:
        """Whether every rule fired."""
        return self.position == len(self.rules)

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
        """Whether some rule has a ``val_loss_below`` trigger (the run must evaluate)."""
        return any(rule.when.val_loss_below is not None for rule in self.rules)

    def may_fire(self, step: int, *, evaluated: bool) -> bool:
        """Whether a rule could fire at this check: the gate in front of the collective.

        A pure function of ``step``, ``evaluated`` and the position, which are the same on every
        rank, so every rank takes the same branch: all enter the broadcast, or none does. It
        never looks at the loss's value, which a rank may see differently. True when the next
        rule has a loss trigger and this check has a validation loss, or when its step timeout
        is reached.
        """
        if self.done:
            return False
        when = self.rules[self.position].when
        if evaluated and when.val_loss_below is not None:
            return True
        return when.at_latest_step is not None and step >= when.at_latest_step

    def evaluate(self, step: int, val_loss: float | None = None) -> Decision | None:
        """What the rules decide at this check, from this rank's view; changes nothing.

        Not a collective: :meth:`decide` runs it on rank 0 only. The result is a pure function
        of the position, ``step`` and ``val_loss``.
        """
        fired: list[Fired] = []
        multiplier, lr_changed = self._lr_multiplier, False
        batch_size: int | None = None
        accumulation: int | None = None
        stop = save = False
        for index in range(self.position, len(self.rules)):
            rule = self.rules[index]
            reason = _reason(rule.when, step, val_loss)
            if reason is None:
                break
            fired.append(Fired(rule=index, step=step, reason=reason, val_loss=val_loss))
            do = rule.do
            if do.lr_multiplier is not None:
                multiplier, lr_changed = multiplier * do.lr_multiplier, True
            batch_size = do.batch_size if do.batch_size is not None else batch_size
            accumulation = (
                do.accumulation_steps if do.accumulation_steps is not None else accumulation
            )
            stop, save = stop or do.stop, save or do.save
        if not fired:
            return None
        return Decision(
            step=step,
            fired=tuple(fired),
            lr_multiplier=multiplier if lr_changed else None,
            batch_size=batch_size,
            accumulation_steps=accumulation,
            stop=stop,
            save=save,
        )

    def decide(self, ctx: RunContext, step: int, val_loss: float | None = None) -> Decision | None:
        """Rank 0 evaluates the rules; every rank gets its decision and moves the schedule on.

        Call it on every rank at every optimizer step, after ``optimizer.step()``, with
        ``step`` the number of optimizer steps done; at a step that evaluated, after the
        evaluation, with ``val_loss`` the validation loss (every rank passes one at the same
        steps; only rank 0's value counts, so a rank's local or stale value cannot split the
        ranks). It is a collective only when :meth:`may_fire` says a rule could fire, a choice
        every rank makes alike; other calls cost nothing.

        Returns the decision, the same on every rank, or ``None`` when no rule fired. The
        caller applies it (``docs/decisions.md``: LR, batch size, accumulation, save, stop).
        Rank 0 logs one ``schedule rule fired`` event per rule.

        :raises ups.core.RankFailedError: on every rank, if evaluating failed on rank 0.
        """
        if not self.may_fire(step, evaluated=val_loss is not None):
            return None
        from ..dist import _collectives as collectives

        decision = collectives.decide(ctx, lambda: self.evaluate(step, val_loss))
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
                    do=self.rules[fired.rule].do.actions(),
                    lr_multiplier=self._lr_multiplier,
                    batch_size=self._batch_size,
                    accumulation_steps=self._accumulation_steps,
                )
        return decision

    def _apply(self, decision: Decision) -> None:
        if [f.rule for f in decision.fired] != list(
            range(self.position, self.position + len(decision.fired))
        ):
            raise RuntimeError(
                f"decision fires rules {[f.rule for f in decision.fired]} but the schedule is "
                f"at rule {self.position}; the ranks' schedules have diverged"
            )
        self._fired.extend(decision.fired)
        if decision.lr_multiplier is not None:
            self._lr_multiplier = decision.lr_multiplier
        if decision.batch_size is not None:
            self._batch_size = decision.batch_size
        if decision.accumulation_steps is not None:
            self._accumulation_steps = decision.accumulation_steps

    def state_dict(self) -> dict[str, Any]:
        """The position, as plain data (loadable with ``torch.load(weights_only=True)``).

        Each fired rule is saved with its own configuration, so that resuming with a schedule
        whose fired rules were edited is caught.
        """
        return {
            "version": STATE_VERSION,
            "fired": [
                {**attrs.asdict(f), "config": attrs.asdict(self.rules[f.rule])} for f in self._fired
            ],
            "lr_multiplier": self._lr_multiplier,
            "batch_size": self._batch_size,
            "accumulation_steps": self._accumulation_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position: the fired rules stay fired, and the saved LR
        multiplier, batch size and accumulation steps replace the configured ones.

        Every rank loads the same state, so the schedules stay identical.

        :raises UsageError: when a rule that already fired is missing or differs in this
            schedule (rules not yet fired may be changed or added).
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unknown schedule state version {state.get('version')!r}")
        fired = []
        for index, entry in enumerate(state["fired"]):
            saved = entry["config"]
            if entry["rule"] != index:
                raise ValueError(f"schedule state fires rule {entry['rule']} in place {index}")
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
                )
            )
        self._fired = fired
        self._lr_multiplier = float(state["lr_multiplier"])
        self._batch_size = int(state["batch_size"])
        self._accumulation_steps = int(state["accumulation_steps"])


def _rule_from_dict(data: Mapping[str, Any]) -> Rule:
    """A :class:`Rule` from ``attrs.asdict(rule)`` (as a state dict stores it)."""
    return Rule(when=Trigger(**data["when"]), do=Action(**data["do"]))


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
