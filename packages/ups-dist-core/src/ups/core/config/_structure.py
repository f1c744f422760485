"""Build frozen attrs classes from plain data (parsed YAML), naming the key path of any mistake.

Supported field types: ``bool``, ``int``, ``float``, ``str``, ``None``, ``Literal[...]``, unions
of those, ``tuple[T, ...]``, ``dict[str, Any]`` and nested attrs classes. Field validators run
before the instance is built, so their complaint is reported at the field's key path.

Numbers are those the code consuming them can take, whatever the field: an ``int`` fits in 64
bits (:data:`INT_BOUND`) and a ``float`` is finite (no ``.nan``, ``.inf``). Values of ``Any``
(a factory's ``options``) are passed on as they are.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import attrs

from ._errors import ConfigError, did_you_mean, one_of

T = TypeVar("T")

INT_BOUND = 2**63
"""An ``int`` field's value is in ``[-INT_BOUND, INT_BOUND)``: a C ``int64``, what ``torch``,
``itertools`` and ``numpy`` take."""


@attrs.frozen(repr=False)
class at_least:  # noqa: N801 - a validator reads like a phrase: at_least(1)
    """Validator: the value is ``>= bound`` (or ``None``)."""

    bound: float

    def __call__(self, _inst: object, _attr: attrs.Attribute[Any], value: float | None) -> None:
        if value is not None and value < self.bound:
            raise ValueError(f"must be >= {self.bound}")

    def __repr__(self) -> str:
        return f"at_least({self.bound})"


@attrs.frozen(repr=False)
class above:  # noqa: N801
    """Validator: the value is ``> bound`` (or ``None``)."""

    bound: float

    def __call__(self, _inst: object, _attr: attrs.Attribute[Any], value: float | None) -> None:
        if value is not None and value <= self.bound:
            raise ValueError(f"must be > {self.bound}")

    def __repr__(self) -> str:
        return f"above({self.bound})"


@attrs.frozen(repr=False)
class at_most:  # noqa: N801
    """Validator: the value is ``<= bound`` (or ``None``)."""

    bound: float

    def __call__(self, _inst: object, _attr: attrs.Attribute[Any], value: float | None) -> None:
        if value is not None and value > self.bound:
            raise ValueError(f"must be <= {self.bound:g}")

    def __repr__(self) -> str:
        return f"at_most({self.bound})"


def structure(cls: type[T], data: object, path: str = "") -> T:
    """Build ``cls`` (an attrs class) from ``data`` (a mapping), checking every key and value.

    :raises ConfigError: naming the key path, the bad value and what is allowed.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping of keys, got {_show(data)}")
    fields = {f.name: f for f in attrs.fields(typing.cast(Any, cls)) if f.init}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(
                _join(path, str(key)),
                f"unknown key; allowed: {one_of(fields)}{did_you_mean(str(key), fields)}",
            )
    kwargs = {}
    for name, field in fields.items():
        if name not in data:
            if field.default is attrs.NOTHING:
                raise ConfigError(_join(path, name), "is required")
            continue
        key = _join(path, name)
        value = _convert(hints[name], data[name], key)
        if field.validator is not None:
            try:
                field.validator(None, field, value)
            except (ValueError, TypeError) as error:
                raise ConfigError(key, f"{_show(value)} is not allowed: {error}") from None
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ValueError as error:  # a check across fields, in the class's __attrs_post_init__
        raise ConfigError(path, str(error)) from None


def _convert(tp: Any, value: object, key: str) -> Any:
    origin = typing.get_origin(tp)
    if attrs.has(tp):
        return structure(tp, value, key)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        # bool is an int: compare with types, so `1` is not taken for `True`.
        if any(value == a and type(value) is type(a) for a in allowed):
            return value
        raise ConfigError(key, f"{_show(value)} is not one of {_choices(allowed)}")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        nested = [o for o in options if attrs.has(o)]
        if value is not None and len(nested) == 1:
            return structure(nested[0], value, key)  # its own errors, key by key
        for option in options:
            try:
                return _convert(option, value, key)
            except _OutOfRangeError:
                raise
            except ConfigError:
                continue
        raise ConfigError(key, f"{_show(value)} is not {_describe(tp)}")
    if origin is tuple:
        (item, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"expected a list, got {_show(value)}")
        return tuple(_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(key, f"expected a mapping with string keys, got {_show(value)}")
        (_key_type, value_type) = typing.get_args(tp)
        return {k: _convert(value_type, v, _join(key, k)) for k, v in value.items()}
    if (tp is int and type(value) is int) or (tp is float and type(value) in (int, float)):
        return _number(tp, value, key)  # type: ignore[arg-type]
    if tp is type(None) and value is None:
        return None
    if tp in (bool, str) and type(value) is tp:
        return value
    if tp is Any:
        return value
    raise ConfigError(key, f"expected {_describe(tp)}, got {_show(value)}")


class _OutOfRangeError(ConfigError):
    """A number of the field's type that no consumer takes (not tried against other types)."""


def _number(tp: type[int] | type[float], value: float, key: str) -> float:
    """``value`` as ``tp`` (an int is a float too), if its consumers take it.

    :raises _OutOfRangeError: for an int beyond 64 bits, or a float that is not finite.
    """
    if tp is int:
        if -INT_BOUND <= value < INT_BOUND:
            return value
        bound = f"<= {INT_BOUND - 1}" if value > 0 else f">= {-INT_BOUND}"
        raise _OutOfRangeError(key, f"{value} is not allowed: must be {bound} (64 bits)")
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        number = math.inf
    if math.isfinite(number):
        return number
    shown = {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}.get(str(value), str(value))
    raise _OutOfRangeError(key, f"{shown} is not allowed: must be a finite number")


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return f"one of {_choices(typing.get_args(tp))}"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, "null" if tp is type(None) else getattr(tp, "__name__", str(tp)))


def _choices(values: tuple[Any, ...]) -> str:
    return ", ".join(_yaml(v) for v in values)


def _yaml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def _show(value: object) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value) if isinstance(value, str) else _yaml(value)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
