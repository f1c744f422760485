"""Checks of a Python API's arguments, made where an object is built (never on a hot path).

Each check returns the value or raises one error that names the argument, says what is allowed
and shows what was given: ``seed: must be an int, not '0'``. A value of the wrong type raises
:class:`ArgumentTypeError`, a value of the right type that is not allowed
:class:`ArgumentValueError`: each a ``TypeError`` or ``ValueError``, as Python's conventions
ask, and a :class:`~ups.core.config._errors.ConfigError` (a user's mistake, which the CLI prints on one
line), as the APIs that check their arguments were documented to raise before.
"""

from __future__ import annotations

import enum
import math
import numbers
import types
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from ._errors import ConfigError, did_you_mean

__all__ = [
    "ArgumentTypeError",
    "ArgumentValueError",
    "boolean",
    "check_type",
    "choice",
    "integer",
    "number",
    "saved_rank_state",
    "shown",
    "wrong_type",
    "wrong_value",
]
"""A public module: other distributions and plugins check their own APIs' arguments with it."""

T = TypeVar("T")

LONGEST = 40
"""The most characters of a value a message shows."""


class ArgumentTypeError(ConfigError, TypeError):
    """An argument of a type its function does not take."""


class ArgumentValueError(ConfigError, ValueError):
    """An argument of the right type whose value its function does not allow."""


def shown(value: object) -> str:
    """``value`` as a message shows it: an enum's member by name (``Signals.SIGKILL``), the
    ``repr`` of a number, string or ``None`` (cut to :data:`LONGEST` characters), else its type
    (``a TensorDataset``)."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, bool | int | float | str):
        text = repr(value)
        return text if len(text) <= LONGEST else f"{text[: LONGEST - 3]}..."
    kind = type(value).__name__
    return f"{'an' if kind[0].lower() in 'aeiou' else 'a'} {kind}"


def wrong_type(name: str, value: object, allowed: str) -> ArgumentTypeError:
    """The error for ``value`` of argument ``name``, of a type it does not take: ``name: must
    be <allowed>, not <value>``."""
    return ArgumentTypeError(name, f"must be {allowed}, not {shown(value)}")


def wrong_value(name: str, value: object, allowed: str) -> ArgumentValueError:
    """The error for ``value`` of argument ``name``, of the right type but not allowed."""
    return ArgumentValueError(name, f"must be {allowed}, not {shown(value)}")


def check_type(name: str, value: object, kind: type[Any] | types.UnionType, allowed: str) -> None:
    """Check that ``value`` is an instance of ``kind`` (described to the user as ``allowed``).

    :raises ArgumentTypeError: otherwise.
    """
    if not isinstance(value, kind):
        raise wrong_type(name, value, allowed)


def boolean(name: str, value: object) -> bool:
    """``value``, ``True`` or ``False`` (not merely truthy: ``"no"`` is a mistake).

    :raises ArgumentTypeError: otherwise.
    """
    if not isinstance(value, bool):
        raise wrong_type(name, value, "True or False")
    return value


def integer(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int``: an integral number (a NumPy one too), not a bool, in
    ``[low, high]``.

    :raises ArgumentTypeError: for another type.
    :raises ArgumentValueError: for an int out of range.
    """
    if low is not None and high is not None:
        allowed = f"an int from {low} to {high}"
    else:
        allowed = "an int" + (f" >= {low}" if low is not None else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise wrong_type(name, value, allowed)
    number = int(value)
    if (low is not None and number < low) or (high is not None and number > high):
        raise wrong_value(name, value, allowed)
    return number


def number(
    name: str, value: object, *, above: float | None = None, at_least: float | None = None
) -> float:
    """``value`` as a ``float``: a finite real number (an int too, not a bool), ``> above``
    and ``>= at_least`` where given.

    :raises ArgumentTypeError: for another type.
    :raises ArgumentValueError: for infinity, NaN or a number out of range.
    """
    allowed = "a finite number"
    allowed += f" > {above:g}" if above is not None else ""
    allowed += f" >= {at_least:g}" if at_least is not None else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise wrong_type(name, value, allowed)
    real = float(value)
    if (
        not math.isfinite(real)
        or (above is not None and not real > above)
        or (at_least is not None and not real >= at_least)
    ):
        raise wrong_value(name, value, allowed)
    return real


def choice(name: str, value: object, choices: Sequence[T]) -> T:
    """``value``, one of ``choices`` (of the same type: ``1`` is not ``True``).

    :raises ArgumentValueError: for a value of a choice's type that is none of them (with the
        closest one, for a string).
    :raises ArgumentTypeError: for a value of another type.
    """
    for allowed in choices:
        if type(value) is type(allowed) and value == allowed:
            return allowed
    listed = ", ".join(repr(c) for c in choices)
    problem = f"must be one of {listed}, not {shown(value)}"
    if not any(type(value) is type(c) for c in choices):
        raise ArgumentTypeError(name, problem)
    if isinstance(value, str):
        problem += did_you_mean(value, [c for c in choices if isinstance(c, str)])
    raise ArgumentValueError(name, problem)


def saved_rank_state(
    state: Mapping[str, Any], rank_state: Mapping[str, Any] | None
) -> Mapping[str, Any]:
    """The rank state a ``save`` writes, its arguments checked on this rank before any
    collective (a wrong type is a mistake every rank makes alike): ``None`` is an empty one.

    :raises ArgumentTypeError: naming ``state`` or ``rank_state``, when not a mapping.
    """
    check_type("state", state, Mapping, "a mapping (such as a dict of state dicts)")
    if rank_state is None:
        return {}
    check_type("rank_state", rank_state, Mapping, "a mapping or None")
    return rank_state
