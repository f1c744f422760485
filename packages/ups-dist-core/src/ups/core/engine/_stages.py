"""A run of several stages (``stages``): each stage a training of its own config
(:func:`~ups.core.config._config.stage_config`), run in order by every rank in one process
group and one run folder (:func:`~ups.core.engine._run.train_stages`), its steps numbered on
from the stage before's; this module holds what the stages hand on to one another.

Each stage builds its own parts: a fresh optimizer, LR scheduler, gradient scaler, EMA,
plateau watches, keep-best set and schedule (its rules count the stage's own steps), its data
order and initial weights as a run of its config alone would have them; only the step
numbers (``metrics.jsonl``, the trackers, checkpoints, ``ups report``) go on. A finished
stage's weights are kept in ``stages/NAME/`` (:data:`KEPT`): ``model.pt``, its final
``state_dict``, ``ema.pt`` its EMA's (with ``training.ema``), ``best.pt`` its best
checkpoint's (with ``checkpoint.options.keep_best``: the checkpoint ``best`` names once it
ends), and last ``stage.json``, which marks it done. A later stage starts from them (``model.init_from: {stage: NAME}``) or gets
the model they make, frozen, as a factory's keyword argument (a ``{stage: NAME}`` option of
``model.options`` or ``step.options``: :func:`runnable`).

A resume skips the stages done, and goes on in the stage its newest checkpoint was saved in
(checkpoints record it), its checks against that stage's config.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import structlog
import torch
from torch import nn

from ..checkpoint._files import write_atomically
from ..checkpoint._model_state import load_model_state
from ..checkpoint._serialize import load
from ..config._config import Config, InitFrom, stage_config, stage_refs
from ..config._errors import ConfigError
from ..plugin._records import Checkpointer, Loaded, TrainResult
from ._ema import EMA
from ._resume import InStage, Saved
from ._step import build_model
from ._strategy import Strategy

log = structlog.get_logger()

KEPT = "stages"
"""The run folder's folder of the stages' kept weights, one folder per stage's name."""
DONE = "stage.json"
"""A stage's file saying it is done (``{"index", "name", "start", "end"}``), written last."""
WEIGHTS = {"latest": "model.pt", "ema": "ema.pt", "best": "best.pt"}
"""The kept file of each choice of weights."""


def kept(run_dir: Path, name: str, weights: str = "latest") -> Path:
    """The file holding stage ``name``'s kept ``weights`` in the run folder ``run_dir``."""
    return run_dir / KEPT / name / WEIGHTS[weights]


def kept_to_read(run_dir: Path, name: str, weights: str, key: str) -> Path:
    """:func:`kept`, for a later stage to read: a stage that kept no such weights (its best,
    where it ended before any evaluation was ranked) is a :class:`ConfigError` at ``key``."""
    path = kept(run_dir, name, weights)
    if not path.is_file():
        raise ConfigError(
            key,
            f"stage {name!r} kept no {weights} weights ({path} is missing: no evaluation of "
            f"it was ranked before it ended); use weights: latest",
        )
    return path


def runnable(config: Config, index: int, device: torch.device, *, trained: bool = True) -> Config:
    """Stage ``index``'s config as its training takes it: ``model.init_from.stage`` as the
    earlier stage's kept file, and each ``{stage: NAME}`` option of ``model.options`` and
    ``step.options`` as the module NAME's kept weights make (built by NAME's config, in
    ``eval()`` mode, ``requires_grad`` off, on ``device``): the factory gets it as that
    keyword argument. Not ``trained`` (``ups validate``, before any stage ran): the modules
    as built, ``model.init_from`` as it is."""
    staged = stage_config(config, index)
    names = {stage.name: i for i, stage in enumerate(config.stages)}
    init_from = staged.model.init_from
    if trained and init_from is not None and init_from.stage is not None:
        path = kept_to_read(
            config.run_dir, init_from.stage, init_from.weights, "model.init_from.weights"
        )
        init_from = InitFrom(path=str(path), strict=init_from.strict)
    options: dict[str, dict[str, Any]] = {
        "model": dict(staged.model.options),
        "step": dict(staged.step.options),
    }
    for ref in stage_refs(staged):
        key = f"{ref.section}.options.{ref.option}"
        earlier = frozen(config, names[ref.stage], ref.weights, device, key, trained=trained)
        options[ref.section][ref.option] = earlier
    model = attrs.evolve(staged.model, options=options["model"], init_from=init_from)
    return attrs.evolve(
        staged, model=model, step=attrs.evolve(staged.step, options=options["step"])
    )


def frozen(
    config: Config,
    index: int,
    weights: str,
    device: torch.device,
    key: str,
    *,
    trained: bool = True,
) -> nn.Module:
    """The model of ``config``'s stage ``index``, holding its kept ``weights`` (not
    ``trained``: as built), frozen: in ``eval()`` mode, no gradients, on ``device``; ``key``:
    the option that names it, for errors."""
    name = config.stages[index].name
    model = build_model(runnable(config, index, device, trained=trained))
    if trained:
        _load_kept(model, kept_to_read(config.run_dir, name, weights, key), index)
    return model.to(device).eval().requires_grad_(False)


def _load_kept(model: nn.Module, path: Path, index: int) -> None:
    """Load the kept weights ``path`` of stage ``index`` into ``model``."""
    with open(path, "rb") as file:
        state = load(file, str(path))
    load_model_state(
        model,
        state,
        key=f"stages[{index}]",
        source=str(path),
        advice="does its model.factory still build the model that stage trained?",
    )


def done_at(run_dir: Path, name: str) -> int | None:
    """The step stage ``name`` ended at, if the run folder keeps it as done; else ``None``."""
    path = run_dir / KEPT / name / DONE
    return int(json.loads(path.read_text())["end"]) if path.is_file() else None


def best_model(checkpointer: Checkpointer, best: Mapping[int, float]) -> dict[str, Any] | None:
    """The weights of a finished stage's best checkpoint, the one ``checkpointer``'s ``best``
    pointer names, read on every rank (a collective), when it is one of the stage's ``best``
    (keep-best's kept set, ``{step: value}``); ``None`` when the stage kept none."""
    load_best = getattr(checkpointer, "load_best", None)
    loaded: Loaded | None = load_best() if best and callable(load_best) else None
    if loaded is None or loaded.step not in best:
        return None
    model: dict[str, Any] = Saved.from_dict(loaded.state, loaded.location).model
    return model


def kept_weights(
    strategy: Strategy, model: nn.Module, ema: EMA | None, best: Mapping[str, Any] | None
) -> dict[str, Mapping[str, Any]]:
    """A finished stage's weights to keep, full (a collective under a sharded strategy): the
    model's (``latest``), ``ema``'s, and its ``best`` checkpoint's (:func:`best_model`)."""
    states: dict[str, Mapping[str, Any]] = {"latest": strategy.gathered(model.state_dict())}
    if ema is not None:
        states["ema"] = strategy.gathered(ema.averaged())
    if best is not None:
        states["best"] = best
    return states


def keep(config: Config, states: Mapping[str, Mapping[str, Any]], stage: InStage, end: int) -> None:
    """Keep the finished ``stage``'s weights (:func:`kept_weights`) in ``stages/NAME/``, then
    mark it done at step ``end`` (on rank 0)."""
    folder = config.run_dir / KEPT / stage.name
    folder.mkdir(parents=True, exist_ok=True)
    for weights, state in states.items():
        data = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in state.items()}, data)
        write_atomically(kept(config.run_dir, stage.name, weights), data.getvalue())
    done = {"index": stage.index, "name": stage.name, "start": stage.start, "end": end}
    write_atomically(folder / DONE, json.dumps(done) + "\n")


def together(results: list[TrainResult], step: int) -> TrainResult:
    """One result of the stages' ``results`` (``step``: where the run ended)."""
    if not results:
        log.info(f"the run is complete at step {step}: every stage is done", step=step)
        return TrainResult(steps=step, epochs=0, losses=(), checkpoint=None)
    last = results[-1]
    return attrs.evolve(
        last,
        losses=tuple(loss for r in results for loss in r.losses),
        metrics=tuple(m for r in results for m in r.metrics),
        eval_metrics=tuple(m for r in results for m in r.eval_metrics),
    )
