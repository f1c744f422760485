"""How a stage's ``overrides`` (``stages``) make its config out of the base config's plain data:
merged into it (a section key by key, any other value whole: :func:`merged`), refused where
they set a key of the whole run (:func:`run_key`), and the factory options that ask for an
earlier stage's model (:func:`option_refs`). :func:`~ups.core.config._config.stage_config`
builds a stage's config with them.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

RUN_KEYS = (
    "run.name",
    "run.output_dir",
    "distributed",
    "launch",
    "checkpoint.name",
    "checkpoint.resume",
    "plugins",
    "stages",
)
"""Keys of the run as a whole, which a stage's ``overrides`` may not set."""

REF_KEYS = frozenset({"stage", "weights"})
"""The keys of a factory option's value that names an earlier stage's model:
``{stage: NAME}``, ``{stage: NAME, weights: latest|ema|best}``."""
KEPT_WEIGHTS = ("latest", "ema", "best")
"""The weights a finished stage keeps (``ema``: with ``training.ema``; ``best``: with
``checkpoint.options.keep_best``), which a later stage may name."""


@attrs.frozen
class Ref:
    """A factory option of a stage's config that asks for an earlier stage's trained model."""

    section: str
    """``model`` or ``step``: whose ``options``."""
    option: str
    """The option's name: the factory's keyword argument that receives the model."""
    stage: str
    weights: str


def option_refs(section: str, options: Mapping[str, Any]) -> Iterator[Ref]:
    """The options of ``section``'s factory (its ``options``) that name an earlier stage."""
    for option, value in options.items():
        if isinstance(value, Mapping) and "stage" in value and set(value) <= REF_KEYS:
            yield Ref(section, option, value["stage"], value.get("weights", "latest"))


def merged(cls: type, base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` (the plain data of the attrs class ``cls``) with ``overrides`` set: a section
    (a field holding an attrs class) key by key, any other value whole."""
    hints = typing.get_type_hints(cls)
    result = dict(base)
    for key, value in overrides.items():
        section = _section(hints.get(key))
        if (
            section is not None
            and isinstance(value, Mapping)
            and isinstance(base.get(key), Mapping)
        ):
            result[key] = merged(section, base[key], value)
        else:
            result[key] = value
    return result


def picked(resolved: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides``'s keys with their values as ``resolved`` (the stage's config as plain data)
    holds them: its file paths made absolute."""
    return {
        key: picked(resolved[key], value)
        if isinstance(value, Mapping) and isinstance(resolved.get(key), Mapping)
        else resolved[key]
        for key, value in overrides.items()
    }


def run_key(overrides: Mapping[str, Any]) -> str | None:
    """The first key of the whole run (:data:`RUN_KEYS`) that ``overrides`` sets, or ``None``."""
    for key in RUN_KEYS:
        section, _, name = key.partition(".")
        value = overrides.get(section)
        if section in overrides and (not name or (isinstance(value, Mapping) and name in value)):
            return key
    return None


def _section(tp: Any) -> type | None:
    """The attrs class a field of type ``tp`` holds (``X`` or ``X | None``), or ``None``."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    found = [option for option in (typing.get_args(tp) if union else (tp,)) if attrs.has(option)]
    return found[0] if len(found) == 1 else None
