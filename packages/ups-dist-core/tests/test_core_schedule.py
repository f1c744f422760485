"""The synchronised schedule: rank 0 decides, every rank applies the same decision in the same step.

Multi-rank tests run on real 2-rank gloo groups (``run_ranks``); the rest on one process, where
``decide`` evaluates locally.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import structlog
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ups.core import ConfigError, RunContext, UsageError
from ups.core.config._structure import structure
from ups.core.dist import _collectives as collectives
from ups.core.engine._schedule import (
    MULTIPLIER_KEY,
    Action,
    Decision,
    Fired,
    Rule,
    Schedule,
    Trigger,
    apply_lr_multiplier,
    schedule_warnings,
)
from ups.core.testing import run_ranks

Trace = Sequence[tuple[int, float | None]]


def rule(val_loss_below: float | None = None, at_latest_step: int | None = None, **do: Any) -> Rule:
    return Rule(
        when=Trigger(val_loss_below=val_loss_below, at_latest_step=at_latest_step),
        do=Action(**do),
    )


def run(schedule: Schedule, ctx: RunContext, trace: Trace) -> list[Decision]:
    """Call ``decide`` at each ``(step, val_loss)`` of the trace, as the engine does."""
    decisions = []
    for step, val_loss in trace:
        decision = schedule.decide(ctx, step, val_loss)
        if decision is not None:
            decisions.append(decision)
    return decisions


def every_step(last: int, losses: dict[int, float]) -> list[tuple[int, float | None]]:
    """Steps 1..last, with a validation loss at the steps that ``losses`` names."""
    return [(step, losses.get(step)) for step in range(1, last + 1)]


def reload(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` after a trip through a checkpoint file that refuses code (weights_only)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


# --- the example schedule: seed 000's stages --------------------------------------------------

STAGES = (
    rule(0.1, 20, batch_size=16, lr_multiplier=2.0),
    rule(0.035, accumulation_steps=2, save=True),
    rule(at_latest_step=28, stop=True),
)
# Rank 0's validation losses, every 5 steps: below 0.1 at step 15, below 0.035 at step 25.
RANK_0_LOSSES = {5: 0.5, 10: 0.3, 15: 0.08, 20: 0.04, 25: 0.03, 30: 0.01}
# Rank 1 sees other values: 0.0 would fire every loss rule at step 5, 9.0 none.
RANK_1_LOSSES = {5: 0.0, 10: 0.0, 15: 9.0, 20: 0.0, 25: 9.0, 30: 0.0}


def stages_on_ranks(ctx: RunContext) -> tuple[list[Decision], dict[str, Any], int]:
    """Each rank passes its own losses; returns its decisions, state and log events."""
    losses = RANK_0_LOSSES if ctx.rank == 0 else RANK_1_LOSSES
    schedule = Schedule(STAGES, batch_size=8)
    with structlog.testing.capture_logs() as logs:
        decisions = run(schedule, ctx, every_step(30, losses))
    events = [e for e in logs if e["event"] == "schedule rule fired"]
    return decisions, schedule.state_dict(), len(events)


EXPECTED_STAGES = [
    Decision(
        step=15,
        fired=(Fired(rule=0, step=15, reason="val_loss_below", val_loss=0.08),),
        lr_multiplier=2.0,
        batch_size=16,
        accumulation_steps=None,
        stop=False,
        save=False,
    ),
    Decision(
        step=25,
        fired=(Fired(rule=1, step=25, reason="val_loss_below", val_loss=0.03),),
        lr_multiplier=None,
        batch_size=None,
        accumulation_steps=2,
        stop=False,
        save=True,
    ),
    Decision(
        step=28,
        fired=(Fired(rule=2, step=28, reason="at_latest_step", val_loss=None),),
        lr_multiplier=None,
        batch_size=None,
        accumulation_steps=None,
        stop=True,
        save=False,
    ),
]


def test_every_rank_gets_rank_0s_decision_whatever_its_own_loss() -> None:
    (decisions_0, state_0, logged_0), (decisions_1, state_1, logged_1) = run_ranks(
        stages_on_ranks, 2
    )
    # Rank 1's own losses would have fired rules 0 and 1 at step 5: they were ignored.
    assert decisions_0 == decisions_1 == EXPECTED_STAGES
    assert state_0 == state_1
    assert (state_0["lr_multiplier"], state_0["batch_size"], state_0["accumulation_steps"]) == (
        2.0,
        16,
        2,
    )
    # Logged once: one event per fired rule, on rank 0 only.
    assert (logged_0, logged_1) == (3, 0)
    # The same as one process that sees rank 0's losses.
    alone = run(Schedule(STAGES, batch_size=8), RunContext(), every_step(30, RANK_0_LOSSES))
    assert alone == EXPECTED_STAGES


def resume_on_ranks(ctx: RunContext, split: int) -> tuple[list[Decision], list[Decision]]:
    """An uninterrupted run, and one saved after ``split`` steps and resumed in a new schedule."""
    trace = every_step(30, RANK_0_LOSSES if ctx.rank == 0 else RANK_1_LOSSES)
    whole = run(Schedule(STAGES, batch_size=8), ctx, trace)
    first = Schedule(STAGES, batch_size=8)
    before = run(first, ctx, trace[:split])
    state = reload(first.state_dict())
    resumed = Schedule(STAGES, batch_size=8)
    resumed.load_state_dict(state)
    return whole, before + run(resumed, ctx, trace[split:])


def test_a_resumed_schedule_continues_as_an_uninterrupted_one_on_every_rank() -> None:
    results = run_ranks(resume_on_ranks, 2, 20)
    assert results == [(EXPECTED_STAGES, EXPECTED_STAGES)] * 2


# --- triggers -------------------------------------------------------------------------------


def test_a_loss_rule_fires_once_at_the_first_evaluation_below_the_threshold() -> None:
    schedule = Schedule([rule(0.05, lr_multiplier=0.5)], batch_size=8)
    trace = every_step(40, {10: 0.2, 20: 0.05, 30: 0.049, 40: 0.01})  # 0.05 is not below
    decisions = run(schedule, RunContext(), trace)
    assert [(d.step, d.fired[0].reason, d.fired[0].val_loss) for d in decisions] == [
        (30, "val_loss_below", 0.049)
    ]
    assert schedule.lr_multiplier == 0.5
    assert schedule.done


def test_the_step_timeout_fires_at_its_step_when_the_loss_never_got_there() -> None:
    schedule = Schedule([rule(0.05, 25, batch_size=64)], batch_size=8)
    decisions = run(schedule, RunContext(), every_step(40, {10: 0.2, 20: 0.1, 30: 0.01}))
    assert [(d.step, d.fired[0].reason, d.batch_size) for d in decisions] == [
        (25, "at_latest_step", 64)
    ]
    assert schedule.batch_size == 64


def test_the_timeout_is_void_once_the_loss_fired_the_rule() -> None:
    schedule = Schedule([rule(0.05, 25, batch_size=64)], batch_size=8)
    decisions = run(schedule, RunContext(), every_step(40, {10: 0.01}))
    assert [(d.step, d.fired[0].reason) for d in decisions] == [(10, "val_loss_below")]


def test_rules_fire_in_order_and_a_waiting_rule_fires_with_the_one_before() -> None:
    rules = [
        rule(0.1, save=True),
        rule(0.5, lr_multiplier=2.0),  # holds from the start, but waits for rule 0
        rule(at_latest_step=5, lr_multiplier=3.0),  # overdue by then: fires with them
        rule(0.01, stop=True),
    ]
    schedule = Schedule(rules, batch_size=8)
    decisions = run(schedule, RunContext(), every_step(30, {10: 0.4, 20: 0.05, 30: 0.05}))
    assert decisions == [
        Decision(
            step=20,
            fired=(
                Fired(rule=0, step=20, reason="val_loss_below", val_loss=0.05),
                Fired(rule=1, step=20, reason="val_loss_below", val_loss=0.05),
                Fired(rule=2, step=20, reason="at_latest_step", val_loss=0.05),
            ),
            lr_multiplier=6.0,
            batch_size=None,
            accumulation_steps=None,
            stop=False,
            save=True,
        )
    ]
    assert schedule.position == 3
    assert not schedule.stopped


def test_multipliers_compose_across_decisions_and_the_last_batch_size_wins() -> None:
    rules = [
        rule(at_latest_step=2, lr_multiplier=2.0, batch_size=16),
        rule(at_latest_step=4, lr_multiplier=0.25, batch_size=32, accumulation_steps=4),
        rule(at_latest_step=4, batch_size=24, stop=True),
    ]
    schedule = Schedule(rules, batch_size=8, accumulation_steps=1)
    decisions = run(schedule, RunContext(), every_step(6, {}))
    assert [(d.step, d.lr_multiplier, d.batch_size, d.stop) for d in decisions] == [
        (2, 2.0, 16, False),
        (4, 0.5, 24, True),
    ]
    assert (schedule.lr_multiplier, schedule.batch_size, schedule.accumulation_steps) == (
        0.5,
        24,
        4,
    )
    assert schedule.stopped


def test_no_collective_where_no_rule_can_fire(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = collectives.decide

    def counting(ctx: RunContext, fn: Any) -> Any:
        calls.append(1)
        return real(ctx, fn)

    monkeypatch.setattr(collectives, "decide", counting)
    schedule = Schedule(
        [rule(0.1, 50, save=True), rule(at_latest_step=60, stop=True)], batch_size=8
    )
    run(schedule, RunContext(), every_step(70, {10: 0.5, 20: 0.5, 30: 0.05}))
    # Evaluations at 10, 20, 30 (rule 0 fires at 30); then only step 60 for rule 1.
    assert len(calls) == 4
    assert [f.step for f in schedule.fired] == [30, 60]
    assert schedule.done
    assert not schedule.may_fire(100, evaluated=True)


def test_may_fire_ignores_the_loss_value_and_looks_only_at_the_next_rule() -> None:
    schedule = Schedule([rule(at_latest_step=10, save=True), rule(0.1, stop=True)], batch_size=8)
    assert not schedule.may_fire(9, evaluated=True)  # rule 1's loss trigger waits for rule 0
    assert schedule.may_fire(10, evaluated=False)
    assert schedule.may_fire(11, evaluated=False)


def test_a_nan_loss_fires_nothing_but_the_timeout() -> None:
    schedule = Schedule([rule(0.1, 20, save=True)], batch_size=8)
    decisions = run(schedule, RunContext(), every_step(20, {10: math.nan}))
    assert [(d.step, d.fired[0].reason) for d in decisions] == [(20, "at_latest_step")]


def test_the_decision_is_logged_once_per_rule() -> None:
    schedule = Schedule([rule(0.1, lr_multiplier=2.0), rule(0.2, stop=True)], batch_size=8)
    with structlog.testing.capture_logs() as logs:
        schedule.decide(RunContext(), 10, 0.05)
    assert [
        (e["event"], e["rule"], e["reason"], e["do"], e["lr_multiplier"])
        for e in logs
        if e["event"] == "schedule rule fired"
    ] == [
        ("schedule rule fired", 0, "val_loss_below", {"lr_multiplier": 2.0}, 2.0),
        ("schedule rule fired", 1, "val_loss_below", {"stop": True}, 2.0),
    ]


# --- state ----------------------------------------------------------------------------------


def test_state_dict_round_trip_keeps_the_position() -> None:
    schedule = Schedule(STAGES, batch_size=8)
    run(schedule, RunContext(), every_step(20, RANK_0_LOSSES))
    restored = Schedule(STAGES, batch_size=4, accumulation_steps=3)
    restored.load_state_dict(reload(schedule.state_dict()))
    assert restored.fired == schedule.fired
    assert (restored.lr_multiplier, restored.batch_size, restored.accumulation_steps) == (
        2.0,
        16,
        1,
    )
    assert restored.state_dict() == schedule.state_dict()


def test_resuming_with_an_edited_fired_rule_is_a_usage_error() -> None:
    schedule = Schedule(STAGES, batch_size=8)
    run(schedule, RunContext(), every_step(20, RANK_0_LOSSES))
    state = reload(schedule.state_dict())
    edited = Schedule((rule(0.2, 20, batch_size=16, lr_multiplier=2.0), *STAGES[1:]), batch_size=8)
    with pytest.raises(UsageError, match=r"schedule\[0\] fired at step 15 as .*0\.1.* but is now"):
        edited.load_state_dict(state)
    with pytest.raises(UsageError, match=r"schedule\[0\] .* is now missing"):
        Schedule([], batch_size=8).load_state_dict(state)
    # Rules that have not fired may change.
    extended = Schedule((STAGES[0], rule(0.01, save=True)), batch_size=8)
    extended.load_state_dict(state)
    assert extended.position == 1


# --- the LR -----------------------------------------------------------------------------------


def groups() -> list[dict[str, Any]]:
    """Two param groups: LR 0.1, and the optimizer's default LR (0.3 below)."""
    return [
        {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
        {"params": [torch.nn.Parameter(torch.zeros(1))]},
    ]


LR_RULES = (
    rule(at_latest_step=2, lr_multiplier=2.0),
    rule(at_latest_step=5, lr_multiplier=0.25),
    rule(at_latest_step=9, lr_multiplier=3.0),
)
MULTIPLIER_AFTER = {
    step: 1.0 if step < 2 else 2.0 if step < 5 else 0.5 if step < 9 else 1.5 for step in range(13)
}
LR_SCHEDULERS = {
    "none": None,
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 5)),
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12),
    "linear": lambda opt: torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.2, total_iters=6),
}


def train_lrs(
    scheduler_name: str, rules: Sequence[Rule], resume_at: int | None = None
) -> list[list[float]]:
    """Each optimizer step's LRs (after the step's decision) over 12 steps, as an engine applies
    the schedule; with ``resume_at``, every state goes through a checkpoint after that step."""
    make = LR_SCHEDULERS[scheduler_name]

    def build() -> tuple[torch.optim.Optimizer, Any, Schedule]:
        optimizer = torch.optim.SGD(groups(), lr=0.3)
        scheduler = None if make is None else make(optimizer)
        schedule = Schedule(rules, batch_size=8)
        apply_lr_multiplier(optimizer, schedule.lr_multiplier, scheduler)
        return optimizer, scheduler, schedule

    optimizer, scheduler, schedule = build()
    lrs = []
    for step in range(1, 13):
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        decision = schedule.decide(RunContext(), step)
        if decision is not None and decision.lr_multiplier is not None:
            apply_lr_multiplier(optimizer, decision.lr_multiplier, scheduler)
        lrs.append([group["lr"] for group in optimizer.param_groups])
        if step == resume_at:
            states = [reload(optimizer.state_dict()), reload(schedule.state_dict())]
            scheduler_state = None if scheduler is None else reload(scheduler.state_dict())
            optimizer, scheduler, schedule = build()
            optimizer.load_state_dict(states[0])
            schedule.load_state_dict(states[1])
            if scheduler is not None:
                scheduler.load_state_dict(scheduler_state)
            apply_lr_multiplier(optimizer, schedule.lr_multiplier, scheduler)  # a no-op here
    return lrs


@pytest.mark.parametrize("scheduler_name", sorted(LR_SCHEDULERS))
def test_the_lr_is_the_unmultiplied_lr_times_the_schedules_multiplier(scheduler_name: str) -> None:
    plain = train_lrs(scheduler_name, ())
    multiplied = train_lrs(scheduler_name, LR_RULES)
    expected = [[lr * MULTIPLIER_AFTER[step] for lr in lrs] for step, lrs in enumerate(plain, 1)]
    assert multiplied == [pytest.approx(lrs) for lrs in expected]
    assert train_lrs(scheduler_name, LR_RULES, resume_at=6) == multiplied


def test_apply_lr_multiplier_is_idempotent_and_composes() -> None:
    optimizer = torch.optim.SGD(groups(), lr=0.3)
    lrs = []
    for multiplier in (2.0, 2.0, 0.5, 1.0):
        apply_lr_multiplier(optimizer, multiplier)
        lrs.append([group["lr"] for group in optimizer.param_groups])
    assert lrs == [[0.2, 0.6], [0.2, 0.6], pytest.approx([0.05, 0.15]), pytest.approx([0.1, 0.3])]
    assert [group[MULTIPLIER_KEY] for group in optimizer.param_groups] == [1.0, 1.0]


# --- config -----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Section:
    """How the config holds a schedule: ``schedule: tuple[Rule, ...] = ()``."""

    schedule: tuple[Rule, ...] = ()


def test_the_yaml_of_the_docs_structures() -> None:
    data = {
        "schedule": [
            {
                "when": {"val_loss_below": 0.05, "at_latest_step": 2000},
                "do": {"batch_size": 64, "lr_multiplier": 2},
            },
            {"when": {"at_latest_step": 5000}, "do": {"stop": True}},
        ]
    }
    assert structure(Section, data).schedule == (
        rule(0.05, 2000, batch_size=64, lr_multiplier=2.0),
        rule(at_latest_step=5000, stop=True),
    )
    assert structure(Section, {}).schedule == ()


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"when": {}, "do": {"stop": True}}, "schedule[1].when: {} is not allowed: set"),
        ({"when": {"at_latest_step": 9}, "do": {"stop": False}}, "schedule[1].do: {} is not"),
        ({"when": {"at_latest_step": 9}}, "schedule[1].do: is required"),
        ({"when": {"val_loss_below": "low"}, "do": {"save": True}}, "when.val_loss_below: 'low'"),
        ({"when": {"at_latest_step": 0}, "do": {"save": True}}, "at_latest_step: 0 is not allowed"),
        (
            {"when": {"after_steps": 9}, "do": {"save": True}},
            "schedule[1].when.after_steps: unknown",
        ),
        ({"when": {"at_latest_step": 9}, "do": {"lr_multiplier": 0}}, "do.lr_multiplier: 0.0 is"),
        ({"when": {"at_latest_step": 9}, "do": {"batch_size": 2.5}}, "do.batch_size: 2.5 is not"),
        (
            {"when": {"at_latest_step": 9}, "do": {"stop": "yes"}},
            "schedule[1].do.stop: expected a boolean, got 'yes'",
        ),
    ],
)
def test_a_bad_rule_is_a_config_error_at_its_key_path(item: dict[str, Any], message: str) -> None:
    data = {"schedule": [{"when": {"at_latest_step": 5}, "do": {"save": True}}, item]}
    with pytest.raises(ConfigError) as error:
        structure(Section, data)
    assert message in str(error.value)


def test_schedule_warnings_name_the_rules() -> None:
    rules = [
        rule(0.1, 5000, save=True),
        rule(at_latest_step=2000, stop=True),
        rule(at_latest_step=9000, save=True),
    ]
    assert schedule_warnings(rules, max_steps=8000) == [
        "schedule[1].when.at_latest_step: 2000 is before schedule[0]'s 5000; rules fire in "
        "order, so this one fires at step 5000 at the latest",
        "schedule[2].when.at_latest_step: 9000 is after training.max_steps (8000)",
        "schedule[2]: comes after the stop of schedule[1]; it fires only if its trigger holds "
        "at the same check",
    ]
    assert schedule_warnings(STAGES) == []


# --- properties -----------------------------------------------------------------------------

triggers = st.builds(
    Trigger,
    val_loss_below=st.none() | st.sampled_from([0.1, 0.3, 0.5]),
    at_latest_step=st.none() | st.integers(1, 30),
).filter(lambda t: t.val_loss_below is not None or t.at_latest_step is not None)
actions = st.builds(
    Action,
    lr_multiplier=st.none() | st.sampled_from([0.5, 2.0, 3.0]),
    batch_size=st.none() | st.integers(1, 64),
    accumulation_steps=st.none() | st.integers(1, 4),
    stop=st.booleans(),
    save=st.booleans(),
).filter(lambda a: bool(a.actions()))
rule_lists = st.lists(st.builds(Rule, when=triggers, do=actions), max_size=5)
traces = st.lists(st.none() | st.floats(0, 1), max_size=30).map(
    lambda losses: [(step, loss) for step, loss in enumerate(losses, start=1)]
)


def reference(rules: Sequence[Rule], trace: Trace) -> list[tuple[int, list[int]]]:
    """The documented semantics: rule i fires at the first check, at or after rule i-1's, where
    its loss is below the threshold or its step timeout is reached."""
    fired, position = [], 0
    for step, loss in trace:
        now = []
        while position < len(rules):
            when = rules[position].when
            below = when.val_loss_below
            if not (
                (below is not None and loss is not None and loss < below)
                or (when.at_latest_step is not None and step >= when.at_latest_step)
            ):
                break
            now.append(position)
            position += 1
        if now:
            fired.append((step, now))
    return fired


@settings(max_examples=150, deadline=None)
@given(rules=rule_lists, trace=traces)
def test_decisions_are_a_pure_function_of_the_trace(rules: list[Rule], trace: Trace) -> None:
    ctx = RunContext()
    first = run(Schedule(rules, batch_size=8), ctx, trace)
    assert run(Schedule(rules, batch_size=8), ctx, trace) == first
    assert [(d.step, [f.rule for f in d.fired]) for d in first] == reference(rules, trace)
    multiplier = math.prod(rules[f.rule].do.lr_multiplier or 1.0 for d in first for f in d.fired)
    schedule = Schedule(rules, batch_size=8)
    run(schedule, ctx, trace)
    assert schedule.lr_multiplier == pytest.approx(multiplier)


@settings(max_examples=150, deadline=None)
@given(rules=rule_lists, trace=traces, data=st.data())
def test_resuming_anywhere_continues_identically(
    rules: list[Rule], trace: Trace, data: st.DataObject
) -> None:
    ctx = RunContext()
    whole = Schedule(rules, batch_size=8)
    expected = run(whole, ctx, trace)
    split = data.draw(st.integers(0, len(trace)))
    before = Schedule(rules, batch_size=8)
    decisions = run(before, ctx, trace[:split])
    after = Schedule(rules, batch_size=8)
    after.load_state_dict(reload(before.state_dict()))
    decisions += run(after, ctx, trace[split:])
    assert decisions == expected
    assert after.state_dict() == whole.state_dict()
