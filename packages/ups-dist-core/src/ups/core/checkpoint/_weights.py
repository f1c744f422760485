"""A run's trained weights, read in one process, with no process group: from a run folder
(its newest checkpoint, read through the checkpoint backend its ``config.yaml`` names), from a
checkpoint folder (``checkpoints/step-<N>``) or from a file holding a ``state_dict``. A warm
start (``model.init_from``) loads them into a new run's model, ``ups export`` writes them as a
plain ``state_dict`` (:func:`export_weights`), and :func:`ups.core.load_model` builds a run's
model holding them (:mod:`ups.core.engine._model`).

Which weights of a run folder: ``latest``, its newest checkpoint's model; ``ema``, that
checkpoint's average of the weights (a run with ``training.ema``); ``best``, the model of the
checkpoint its ``best`` pointer names (a run with ``checkpoint.options.keep_best``:
:mod:`~ups.core.checkpoint._best`), for a run folder only.

Everything is read with ``weights_only=True`` (:func:`ups.core.checkpoint.load`): a file that
would run code to load is refused. The module imports torch only to read:
:func:`source_problem` is ``ups validate``'s check, which imports no torch.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import attrs
import yaml

from ..config._config import load_config
from ..config._errors import ConfigError, one_of
from ..plugin._manager import load_plugins
from ._best import KEY as KEEP_BEST

if TYPE_CHECKING:
    from ..plugin._records import Checkpointer, Loaded

Which = Literal["latest", "best", "ema"]
"""Which weights of a run folder (see the module doc)."""
WHICH: tuple[str, ...] = get_args(Which)

RUN_CONFIG = "config.yaml"
"""A run folder's resolved configuration, which marks a folder as a run's."""

COMMIT_FILE = "COMMIT"
"""A committed checkpoint's manifest (:data:`ups.core.checkpoint.COMMIT_FILE`, named here
without importing torch)."""


@attrs.frozen
class Weights:
    """A model's ``state_dict`` as read, and where from (for messages)."""

    state: dict[str, Any]
    source: str
    stage: int = 0
    """The index of the run's stage that saved them (``stages``; ``0`` for a run without, and
    for a ``state_dict`` file)."""


def source_problem(path: Path, which: str) -> str | None:
    """Why ``path`` cannot give the weights ``which``, in a phrase, as far as can be told
    before reading it (no torch needed: a launcher's check before any rank starts); ``None``
    when it may: :func:`path_problem`, then :func:`weights_problem`."""
    return path_problem(path) or weights_problem(path, which)


def path_problem(path: Path) -> str | None:
    """Why ``path`` is no source of weights at all (not there, or neither a run folder, a
    checkpoint folder nor a file); ``None`` when it may be one."""
    if not path.exists():
        return f"{path} does not exist"
    if _kind(path) is None:
        return (
            f"{path} is neither a run folder (with {RUN_CONFIG}), a checkpoint folder (with "
            f"{COMMIT_FILE}) nor a file holding a state_dict"
        )
    return None


def weights_problem(path: Path, which: str) -> str | None:
    """Why the source ``path`` (one :func:`path_problem` finds none in) cannot give the
    weights ``which`` (a problem of the choice of weights, named at its own key); ``None``
    when it may."""
    if which not in WHICH:
        return f"weights {which!r} is not one of {one_of(WHICH)}"
    if which == "best":
        return _best_problem(path)
    if which != "latest" and _kind(path) == "file":
        return f"weights {which!r} is for a run or checkpoint folder; {path} is a file: use latest"
    return None


def run_problem(folder: Path) -> str | None:
    """Why ``folder`` is no run folder (as far as :func:`path_problem` tells, and a
    ``config.yaml`` in it); ``None`` when it may be one."""
    problem = path_problem(folder)
    if problem is None and _kind(folder) != "run":
        return f"{folder} is no run folder (no {RUN_CONFIG} in it)"
    return problem


def read_weights(
    path: Path, which: str = "latest", *, key: str, weights_key: str | None = None
) -> Weights:
    """The weights ``which`` of the run folder, checkpoint folder or ``state_dict`` file
    ``path``, on the CPU, read in this process alone (no collective).

    :param key: the config key or argument naming ``path``, for errors.
    :param weights_key: the one naming ``which``, for errors of the choice of weights
        (:func:`weights_problem`, an EMA the run did not keep); default: ``key``.
    :raises ConfigError: at ``key``, for a path that holds no weights; at ``weights_key``,
        for one that holds no weights ``which``.
    :raises CheckpointError: for a checkpoint that cannot be read (damaged, unsafe:
        :class:`~ups.core.UnsafeCheckpointError`).
    """
    problem = path_problem(path)
    if problem is not None:
        raise ConfigError(key, problem)
    weights_key = weights_key or key
    problem = weights_problem(path, which)
    if problem is not None:
        raise ConfigError(weights_key, problem)
    kind = _kind(path)
    if kind == "file":
        state = _read_file(path)
        return Weights(
            _model_of(state, "latest", str(path), key, weights_key) if _saved(state) else state,
            str(path),
        )
    if kind == "checkpoint":
        from ._commit import STATE_FILE

        if not (path / STATE_FILE).is_file():
            raise ConfigError(
                key,
                f"{path} has no {STATE_FILE} (its backend keeps the state otherwise, as "
                "'sharded' does): give its run folder, whose backend reads it",
            )
        saved = _read_file(path / STATE_FILE)
        return Weights(
            _model_of(saved, which, str(path), key, weights_key), str(path), _stage(saved)
        )
    return _read_run(path, which, key, weights_key)


def export_weights(
    source: Path, output: Path, which: str = "latest", *, key: str, weights_key: str | None = None
) -> Weights:
    """Write the weights ``which`` of ``source`` (:func:`read_weights`) into ``output`` as a
    plain ``state_dict`` (``torch.load(output, weights_only=True)`` reads it), atomically: a
    crash leaves the file whole or absent; return what was written."""
    import torch

    read = read_weights(source, which, key=key, weights_key=weights_key)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.{secrets.token_hex(4)}")
    try:
        torch.save(read.state, partial)
        os.replace(partial, output)
    finally:
        partial.unlink(missing_ok=True)
    return read


def _best_problem(path: Path) -> str | None:
    """Why ``path`` cannot give its best weights: not a run folder, or a run that kept none."""
    if _kind(path) != "run":
        return (
            f"weights 'best' is for a run folder, whose 'best' pointer names its best "
            f"checkpoint; {path} is not one: give its run folder, or use latest"
        )
    with open(path / RUN_CONFIG) as file:
        config = yaml.safe_load(file)
    options = _at(config, "checkpoint", "options")
    if _at(options, "keep_best") is None:
        return (
            f"weights 'best' needs a run saved with {KEEP_BEST}; the run of {path} kept no "
            "best checkpoints: use latest"
        )
    return None


def _at(mapping: object, *keys: str) -> object:
    """``mapping[keys[0]][keys[1]]...``, or ``None`` where one is not there."""
    for key in keys:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(key)
    return mapping


def _kind(path: Path) -> Literal["run", "checkpoint", "file"] | None:
    if path.is_file():
        return "file"
    if (path / RUN_CONFIG).is_file():
        return "run"
    if (path / COMMIT_FILE).is_file():
        return "checkpoint"
    return None


def _read_file(path: Path) -> dict[str, Any]:
    from ._serialize import load

    with open(path, "rb") as file:
        return load(file, str(path))


def _saved(state: dict[str, Any]) -> bool:
    """Whether ``state`` is a checkpoint's training state (its ``state.pt``), not weights."""
    return "format" in state and isinstance(state.get("model"), dict)


def _model_of(
    state: dict[str, Any], which: str, source: str, key: str, weights_key: str
) -> dict[str, Any]:
    """The weights ``which`` of a checkpoint's training state (``Saved``'s mapping); no EMA
    is an error at ``weights_key``, no weights at all at ``key``."""
    weights = state.get("model")
    if which == "ema":
        weights = (state.get("ema") or {}).get("model")
        if not weights:
            raise ConfigError(
                weights_key,
                f"{source} holds no EMA of the weights: its run had no training.ema; use latest",
            )
    if not isinstance(weights, dict):
        raise ConfigError(key, f"{source} holds no model weights (no 'model' in its state)")
    return weights


def _read_run(folder: Path, which: str, key: str, weights_key: str) -> Weights:
    """The weights ``which`` of the run folder ``folder``'s newest checkpoint (for ``best``:
    the checkpoint its ``best`` pointer names), read through its configured checkpoint
    backend, built for one process (no process group)."""
    from ..dist._context import RunContext

    config = load_config(folder / RUN_CONFIG)
    choice = config.checkpoint
    where = f"{folder / RUN_CONFIG}: checkpoint"
    plugin, options = load_plugins().select("checkpoint", choice.name, choice.options, where)
    checkpointer = plugin.factory(ctx=RunContext(), directory=folder, options=options)
    loaded = (
        _load_best(checkpointer, choice.name, folder, weights_key)
        if which == "best"
        else checkpointer.load_latest()
    )
    if loaded is None:
        raise ConfigError(key, f"the run folder {folder} holds no committed checkpoint")
    return Weights(
        _model_of(loaded.state, which, loaded.location, key, weights_key),
        loaded.location,
        _stage(loaded.state),
    )


def _stage(state: dict[str, Any]) -> int:
    """The stage a checkpoint's training state was saved in (``0`` before stages)."""
    stage = state.get("stage", 0)
    return stage if isinstance(stage, int) else 0


def _load_best(checkpointer: Checkpointer, backend: str, folder: Path, weights_key: str) -> Loaded:
    """The checkpoint ``checkpointer``'s ``best`` pointer names (its ``load_best``)."""
    load_best = getattr(checkpointer, "load_best", None)
    if not callable(load_best):
        raise ConfigError(
            weights_key,
            f"the checkpoint backend {backend!r} of {folder} cannot read its best checkpoint "
            "(its checkpointer has no load_best): use latest",
        )
    loaded: Loaded | None = load_best()
    if loaded is None:
        raise ConfigError(
            weights_key,
            f"the run folder {folder} holds no best checkpoint yet (no evaluation has been "
            f"ranked by {KEEP_BEST}): use latest",
        )
    return loaded
