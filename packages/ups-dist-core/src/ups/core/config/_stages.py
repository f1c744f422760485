"""The configs of a run's stages (``stages``): each stage's config is the base config with the
stage's ``overrides`` merged in (sections key by key, any other value replaced whole) and its
``max_steps``/``epochs`` as ``training``'s, built and checked by the same :func:`structure` as
a config, so every rule of a config holds for each stage before any rank starts.

What a stage may not set is the run's as a whole (:data:`RUN_KEYS`): its folder, its process
group, its launcher, its checkpoint backend, whether it resumes, the plugins' sections. What
a stage names of an earlier one (``model.init_from.stage``, a ``{stage: NAME}`` value of
``model.options`` or ``step.options``) must be an earlier stage; the engine gives it
(:mod:`ups.core.engine._stages`).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from ._config import Config, Stage, _resolve_paths
from ._errors import ConfigError, did_you_mean, one_of
from ._structure import structure

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
``{stage: NAME}``, ``{stage: NAME, weights: latest|ema}``."""


@attrs.frozen
class Ref:
    """A factory option of a stage's config that asks for an earlier stage's trained model."""

    section: str
    """``model`` or ``step``: whose ``options``."""
    option: str
    """The option's name: the factory's keyword argument that receives the model."""
    stage: str
    weights: str


def resolve_stages(config: Config, base: Path) -> Config:
    """``config`` with each stage's ``overrides`` checked and their file paths resolved against
    ``base`` (made absolute, as the base config's are).

    :raises ConfigError: at ``stages[i].overrides.KEY`` for an override the config refuses
        (an unknown key, with what is allowed), or at ``stages[i].KEY`` for a stage that names
        no earlier stage or sets a key of the run's.
    """
    init_from = config.model.init_from
    if not config.stages and init_from is not None and init_from.stage is not None:
        raise ConfigError(
            "model.init_from.stage", "names an earlier stage of stages, and this run has none"
        )
    names: dict[str, int] = {}
    stages = []
    for index, stage in enumerate(config.stages):
        if stage.name in names:
            raise ConfigError(
                f"stages[{index}].name",
                f"{stage.name!r} is the name of stages[{names[stage.name]}] too; name each "
                "stage once",
            )
        _refuse_run_keys(stage, index)
        resolved = _resolve_paths(stage_config(config, index), base)
        _check_refs(resolved, index, names, config)
        names[stage.name] = index
        stages.append(
            attrs.evolve(stage, overrides=_picked(attrs.asdict(resolved), stage.overrides))
        )
    return attrs.evolve(config, stages=tuple(stages))


def stage_config(config: Config, index: int) -> Config:
    """The config of ``config``'s stage ``index``: the base config (without ``stages``) with
    the stage's ``overrides``, ``max_steps`` and ``epochs`` set.

    :raises ConfigError: at ``stages[index].overrides.KEY``, for a value the config refuses.
    """
    stage = config.stages[index]
    data = _merged(Config, attrs.asdict(attrs.evolve(config, stages=())), stage.overrides)
    training = dict(data["training"])
    for key in ("max_steps", "epochs"):
        if getattr(stage, key) is not None:
            training[key] = getattr(stage, key)
    data["training"] = training
    try:
        return structure(Config, data)
    except ConfigError as error:
        raise ConfigError(f"stages[{index}].overrides.{error.path}", error.problem) from None


def stage_refs(config: Config) -> Iterator[Ref]:
    """The options of ``config``'s model and step factories that name an earlier stage."""
    for section, options in (("model", config.model.options), ("step", config.step.options)):
        for option, value in options.items():
            if isinstance(value, Mapping) and "stage" in value and set(value) <= REF_KEYS:
                yield Ref(section, option, value["stage"], value.get("weights", "latest"))


def _merged(cls: type, base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` (the plain data of an attrs class ``cls``) with ``overrides`` set: a section
    (a field of an attrs class) key by key, any other value whole."""
    hints = typing.get_type_hints(cls)
    merged = dict(base)
    for key, value in overrides.items():
        section = _section(hints.get(key))
        if (
            section is not None
            and isinstance(value, Mapping)
            and isinstance(base.get(key), Mapping)
        ):
            merged[key] = _merged(section, base[key], value)
        else:
            merged[key] = value
    return merged


def _section(tp: Any) -> type | None:
    """The attrs class a field of type ``tp`` holds (``X`` or ``X | None``), or ``None``."""
    options = (
        typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    )
    found = [option for option in options if attrs.has(option)]
    return found[0] if len(found) == 1 else None


def _picked(resolved: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides``'s keys with their values as ``resolved`` (the stage's config as plain data)
    holds them: file paths made absolute."""
    return {
        key: _picked(resolved[key], value)
        if isinstance(value, Mapping) and isinstance(resolved.get(key), Mapping)
        else resolved[key]
        for key, value in overrides.items()
    }


def _refuse_run_keys(stage: Stage, index: int) -> None:
    """Refuse an override of a key of the run as a whole (:data:`RUN_KEYS`)."""
    for key in RUN_KEYS:
        section, _, name = key.partition(".")
        value = stage.overrides.get(section)
        if section in stage.overrides and (
            not name or (isinstance(value, Mapping) and name in value)
        ):
            raise ConfigError(
                f"stages[{index}].overrides.{key}",
                "is the whole run's, the same in every stage: set it in the base config",
            )


def _check_refs(config: Config, index: int, earlier: Mapping[str, int], run: Config) -> None:
    """Check that what stage ``index``'s ``config`` names of other stages are earlier ones, and
    an EMA one kept.

    :raises ConfigError: at ``stages[index].KEY``, naming the earlier stages.
    """
    init_from = config.model.init_from
    named = [
        (f"{ref.section}.options.{ref.option}", ref.stage, ref.weights)
        for ref in stage_refs(config)
    ]
    if init_from is not None and init_from.stage is not None:
        named.append(("model.init_from.stage", init_from.stage, init_from.weights))
    for key, name, weights in named:
        where = f"stages[{index}].{key}"
        if name not in earlier:
            allowed = one_of(earlier) if earlier else "none (it is the first stage)"
            raise ConfigError(
                where,
                f"{name!r} is no earlier stage; allowed: {allowed}{did_you_mean(str(name), earlier)}",
            )
        if weights not in ("latest", "ema"):
            raise ConfigError(where, f"weights {weights!r}: a stage keeps latest and ema")
        if weights == "ema" and stage_config(run, earlier[name]).training.ema is None:
            raise ConfigError(
                where, f"weights ema: stage {name!r} keeps no EMA (it has no training.ema)"
            )
