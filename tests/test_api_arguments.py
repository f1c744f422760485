"""Every public constructor of the Python API, fed a wrong value for one argument, raises one
error that names that argument (a ``TypeError`` or ``ValueError``, and a ``ConfigError``):
the samplers, ``checkpointer`` and ``save``, ``register_hook``, ``distributed_session`` and
``Preemption`` (:mod:`ups.core.config._arguments`)."""

from __future__ import annotations

import math
import signal
import tempfile
from collections.abc import Callable, Mapping, Sequence, Sized
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import ConcatDataset

from ups.ckpt import checkpointer
from ups.comm_hooks import register_hook
from ups.core import ConfigError, Preemption, RunContext, distributed_session
from ups.samplers import (
    ExactDistributedSampler,
    MultiTaskDistributedSampler,
    TensorDistributedSampler,
)

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=6),
    st.lists(st.integers(-2, 5), max_size=3),
    st.builds(object),
    st.just(torch.zeros(2)),
)
"""Values of every kind a caller may pass by mistake."""

Valid = Callable[[object], bool]


def is_int(low: int | None = None, high: int | None = None) -> Valid:
    def valid(value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int):
            return False
        return (low is None or value >= low) and (high is None or value <= high)

    return valid


def is_bool(value: object) -> bool:
    return isinstance(value, bool)


def is_real(above: float) -> Valid:
    def valid(value: object) -> bool:
        real = isinstance(value, int | float) and not isinstance(value, bool)
        return real and math.isfinite(value) and value > above  # type: ignore[arg-type, operator]

    return valid


def one_of(*choices: object) -> Valid:
    return lambda value: any(type(value) is type(c) and value == c for c in choices)


def or_none(valid: Valid) -> Valid:
    return lambda value: value is None or valid(value)


def is_sizes(value: object) -> bool:
    if isinstance(value, ConcatDataset):
        return True
    return isinstance(value, Sequence) and len(value) > 0 and all(map(is_int(1), value))


WORLD = {"num_replicas": or_none(is_int(1)), "rank": or_none(is_int(0, 1))}
"""A world of two: ``None`` reads the default process group (none here), never a mistake."""
SAMPLERS = {
    **WORLD,
    "seed": is_int(),
    "shuffle": is_bool,
    "chunk_size": is_int(1),
    "dataset": lambda value: isinstance(value, Sized),
}

Call = Callable[[str, object], object]
TARGETS: dict[str, tuple[Call, dict[str, Valid]]] = {
    "MultiTaskDistributedSampler": (
        lambda arg, value: MultiTaskDistributedSampler(
            **{"tasks": [3, 4], "num_replicas": 2, "rank": 0, arg: value}
        ),
        {
            **{k: v for k, v in SAMPLERS.items() if k != "dataset"},
            "tasks": is_sizes,
            "mixing": one_of("balanced", "proportional", "temperature"),
            "temperature": is_real(0),
            "weights": lambda value: value is None,  # given only with mixing 'weights'
            "epoch_size": lambda value: one_of("sum", "max")(value) or is_int(1)(value),
            "drop_last": is_bool,
            "batch_size": is_int(1),
        },
    ),
    "TensorDistributedSampler": (
        lambda arg, value: TensorDistributedSampler(
            **{"dataset": range(10), "num_replicas": 2, "rank": 0, arg: value}
        ),
        {**SAMPLERS, "drop_last": is_bool, "permutation": one_of("torch", "keyed")},
    ),
    "ExactDistributedSampler": (
        lambda arg, value: ExactDistributedSampler(
            **{"dataset": range(10), "num_replicas": 2, "rank": 0, arg: value}
        ),
        SAMPLERS,
    ),
    "checkpointer": (
        lambda arg, value: in_a_folder(
            lambda folder: checkpointer(**{"location": folder, "ctx": RunContext(), arg: value})
        ),
        {
            "location": lambda value: isinstance(value, str),
            "ctx": lambda value: isinstance(value, RunContext),
            "sharded": is_bool,
        },
    ),
    "save": (
        lambda arg, value: in_a_folder(
            lambda folder: checkpointer(folder, ctx=RunContext()).save(
                **{"state": {}, "step": 1, arg: value}
            )
        ),
        {
            "state": lambda value: isinstance(value, Mapping),
            "rank_state": lambda value: value is None or isinstance(value, Mapping),
        },
    ),
    "register_hook": (
        lambda arg, value: register_hook(
            **{"ddp": torch.nn.Linear(1, 1), "name": "allreduce", "ctx": RunContext(), arg: value}
        ),
        {
            "name": one_of("allreduce", "bf16", "fp16", "powersgd", "batched_powersgd", "topk"),
            "ctx": lambda value: isinstance(value, RunContext),
            "ddp": lambda value: False,  # no DistributedDataParallel model is drawn
        },
    ),
    "distributed_session": (
        lambda arg, value: entered(distributed_session, **{"env": {}, arg: value}),
        {
            "enabled": one_of(True, False, "auto"),
            "backend": one_of("auto", "gloo", "nccl"),
            "timeout_s": is_real(0),
            "env": lambda value: value is None or isinstance(value, Mapping),
        },
    ),
    "Preemption": (
        lambda arg, value: Preemption(**{"ctx": RunContext(), arg: value}),
        {
            "ctx": lambda value: isinstance(value, RunContext),
            "signals": lambda value: (
                not isinstance(value, torch.Tensor | signal.Signals)
                and hasattr(value, "__iter__")
                and len(value) == 0  # type: ignore[arg-type]
            ),
        },
    ),
}
"""What builds each constructor with one argument replaced, and when a value is one its
argument takes."""


def in_a_folder(use: Callable[[str], object]) -> object:
    """``use`` called with a fresh folder, deleted after."""
    with tempfile.TemporaryDirectory() as folder:
        return use(folder)


def entered(session: Callable[..., Any], **kwargs: Any) -> None:
    """Enter and leave the context manager ``session(**kwargs)``."""
    with session(**kwargs):
        pass


@pytest.mark.parametrize("target", TARGETS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_wrong_argument_is_one_error_naming_it(target: str, data: st.DataObject) -> None:
    call, arguments = TARGETS[target]
    arg = data.draw(st.sampled_from(sorted(arguments)), label="argument")
    valid = arguments[arg]
    value = data.draw(anything.filter(lambda v: not valid(v)), label="value")
    with pytest.raises((TypeError, ValueError)) as raised:
        call(arg, value)
    assert isinstance(raised.value, ConfigError), repr(raised.value)
    message = str(raised.value)
    assert message.startswith((f"{arg}: ", f"{arg}[")), message
    assert "\n" not in message and (" must be " in message or arg in ("tasks", "weights"))
