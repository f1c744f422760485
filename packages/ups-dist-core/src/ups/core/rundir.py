"""The run's folder, ``run.output_dir/run.name``: what rank 0 writes there besides checkpoints.

- ``config.yaml``: the resolved configuration (overrides applied, file paths absolute), so a
  run can be repeated and compared;
- ``metrics.jsonl``: one JSON object a line for every training report and evaluation, with
  ``kind`` (``train`` or ``eval``) and ``step``;
- ``preempted.json``: ``{"step": N}`` when a preemption signal stopped the run, every rank
  saved at step ``N``; removed when a run starts in the folder. ``ups train --nproc`` reads it
  to exit with its preempted status, since the ranks under its agent exit 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import attrs
import yaml

from .config import Config
from .context import RunContext

PREEMPTED = "preempted.json"


class RunFiles:
    """Rank 0's writer of the run folder's files; on other ranks every method does nothing."""

    def __init__(self, config: Config, ctx: RunContext) -> None:
        self.folder = config.run_dir
        self.enabled = ctx.is_main
        if self.enabled:
            self.folder.mkdir(parents=True, exist_ok=True)
            text = yaml.safe_dump(_plain(attrs.asdict(config)), sort_keys=False)
            (self.folder / "config.yaml").write_text(text)
            (self.folder / PREEMPTED).unlink(missing_ok=True)

    @property
    def metrics_path(self) -> Path:
        return self.folder / "metrics.jsonl"

    def metrics(
        self, kind: Literal["train", "eval"], step: int, values: Mapping[str, float]
    ) -> None:
        """Append one line of metrics (NaN written as ``null``)."""
        if not self.enabled:
            return
        record = {"kind": kind, "step": step} | {
            k: None if isinstance(v, float) and math.isnan(v) else v for k, v in values.items()
        }
        with self.metrics_path.open("a") as file:
            file.write(json.dumps(record) + "\n")

    def preempted(self, step: int) -> None:
        """Record that a preemption signal stopped the run, saved at ``step``."""
        if self.enabled:
            (self.folder / PREEMPTED).write_text(json.dumps({"step": step}) + "\n")


def _plain(value: object) -> object:
    """attrs.asdict output with tuples as lists, so it dumps as plain YAML."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
