"""A model built as a config says and holding saved weights: a run's model out of its folder
(:func:`load_model`, in one process, with no process group) and a warm start
(``model.init_from``: :func:`warm_start`, on every rank of a fresh run). The weights are read
by :mod:`ups.core.checkpoint._weights`; a model that does not fit them is one line naming the
parameters (:func:`~ups.core.checkpoint._model_state.load_model_state`, as for a resume).
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog
import torch
from torch import nn

from ..checkpoint._model_state import Place, load_model_state
from ..checkpoint._weights import (
    RUN_CONFIG,
    Weights,
    Which,
    read_weights,
    run_problem,
    weights_problem,
)
from ..config._config import InitFrom, load_config
from ..dist._context import RunContext
from ._stages import runnable
from ._step import build_model

log = structlog.get_logger()


def load_model(
    run_dir: str | os.PathLike[str],
    *,
    weights: Which = "latest",
    device: str | torch.device = "cpu",
) -> nn.Module:
    """The model of the run folder ``run_dir``, built as its ``config.yaml`` says
    (``model.factory`` and ``model.options``; in a run of ``stages``, those of the stage that
    saved the weights) and holding its weights ``weights`` (see the
    module doc), on ``device``; in this process, with no process group. The folder may have
    been moved or copied together with the project its factory paths name (they are kept
    relative to the folder). It is returned as built (in training mode: call ``.eval()`` to
    infer).

    :raises ValueError: for a ``run_dir`` that is no run folder (naming ``run_dir``), or
        ``weights`` it cannot give (naming ``weights``).
    :raises ConfigError: when the model built does not match the saved weights (one line
        naming the parameters), or at ``weights`` for an EMA its checkpoint does not hold.
    """
    folder = Path(run_dir)
    for name, problem in (
        ("run_dir", run_problem(folder)),
        ("weights", weights_problem(folder, weights)),
    ):
        if problem is not None:
            raise ValueError(f"{name}: {problem}")
    read = read_weights(folder, weights, key="run_dir", weights_key="weights")
    config = load_config(folder / RUN_CONFIG)
    if config.stages:  # the model of the stage that saved the weights, as that stage built it
        config = runnable(config, read.stage, torch.device(device), trained=False)
    model = build_model(config)
    load_model_state(
        model,
        read.state,
        key="run_dir",
        source=read.source,
        advice="does model.factory still build the model that was trained?",
    )
    return model.to(device)


def warm_start(
    model: nn.Module, init_from: InitFrom, ctx: RunContext, place: Place | None = None
) -> Weights:
    """Load ``model.init_from``'s weights into ``model`` (on this rank: every rank reads them
    itself, as a resume does); not ``strict``, rank 0 logs the names left out, one line for
    the model's missing ones and one for the file's unexpected ones.

    ``place``: puts the saved tensors where the model's are (a sharded model's shards).

    :raises ConfigError: at ``model.init_from``, for weights that do not fit (one line).
    """
    assert init_from.path is not None  # a stage's is its kept file (engine._stages.runnable)
    read = read_weights(
        Path(init_from.path),
        init_from.weights,
        key="model.init_from.path",
        weights_key="model.init_from.weights",
    )
    left = load_model_state(
        model,
        read.state,
        key="model.init_from",
        source=read.source,
        advice="start from weights of this model, or set model.init_from.strict: false to "
        "load the names both have (shapes must still agree)",
        strict=init_from.strict,
        place=place,
    )
    if ctx.is_main:
        if left.missing:
            log.warning(
                f"model.init_from: not in {read.source}, left as built: {', '.join(left.missing)}"
            )
        if left.unexpected:
            log.warning(
                f"model.init_from: in {read.source}, not in the model, ignored: "
                f"{', '.join(left.unexpected)}"
            )
        log.info("warm start: the model starts from saved weights", source=read.source)
    return read
