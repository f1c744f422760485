"""The ``tensorboard`` plugin: a logger through the lifecycle hooks.

Rank 0 alone writes, into one TensorBoard run per training run, ``RUN_DIR/tensorboard``: every
training report (``ups_step_end``) and every evaluation (``ups_eval_end``) as scalars at their
optimizer step. The tags group them:

- ``train/NAME``: the training loss, the loss of each task (``train/loss/TASK``), ``lr``, ...
- ``comm/NAME``: the bytes of gradient communication per step (``comm_bytes``,
  ``allreduce_bytes``) and their ratio;
- ``throughput/NAME``: ``samples_per_s``, ``tokens_per_s``, ``tflops``, ``mfu``, ``step_time_s``;
- ``eval/NAME``: the evaluation's loss and each task's.

Installing the distribution enables it for every run; ``UPS_BLOCK_PLUGINS=tensorboard``
disables it.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import structlog

from ups.core import hookimpl

if TYPE_CHECKING:  # torch's TensorBoard writer is imported by the run that writes, not by `ups`
    from torch.utils.tensorboard import SummaryWriter

    from ups.core import Config, RunContext, TrainResult

if importlib.util.find_spec("tensorboard") is None:  # found without importing it (or torch)
    raise ImportError("ups-tensorboard needs the tensorboard package: pip install tensorboard")

log = structlog.get_logger()

GROUPS: Mapping[str, str] = {
    "comm_bytes": "comm",
    "allreduce_bytes": "comm",
    "comm_ratio": "comm",
    "samples_per_s": "throughput",
    "tokens_per_s": "throughput",
    "tflops": "throughput",
    "mfu": "throughput",
    "step_time_s": "throughput",
}
"""The training metrics shown under a group of their own, not ``train/``."""


def tag(kind: Literal["train", "eval"], name: str) -> str:
    """The TensorBoard tag of metric ``name`` of a training report or an evaluation."""
    return f"{GROUPS.get(name, 'train')}/{name}" if kind == "train" else f"eval/{name}"


class TensorBoardLogger:
    """Rank 0's writer for one run; on the other ranks every method does nothing.

    The event file is opened at the run's first report, purging from its step on: a run
    resumed from a checkpoint (after a kill, or restarted by its launcher) reports again the
    steps after it, the first of them first, so TensorBoard drops what the interrupted attempt
    wrote from there, and shows one history, as ``metrics.jsonl`` holds it.
    """

    def __init__(self) -> None:
        self.writer: SummaryWriter | None = None
        self.folder: Path | None = None

    def start(self, ctx: RunContext, folder: Path) -> None:
        """Write the run's events in ``folder`` (rank 0), from its first report on."""
        if ctx.is_main:
            self.folder = folder
            log.info("tensorboard", logdir=str(folder))

    def scalars(
        self, kind: Literal["train", "eval"], step: int, metrics: Mapping[str, float]
    ) -> None:
        """Write one report's metrics at ``step``; NaN (a loss not measured) is left out."""
        if self.writer is None:
            if self.folder is None:
                return
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.folder), purge_step=step)
        for name, value in metrics.items():
            if not math.isnan(value):
                self.writer.add_scalar(tag(kind, name), value, global_step=step)

    def close(self) -> None:
        """Flush and close the event file, if open."""
        if self.writer is not None:
            self.writer.close()
        self.writer = self.folder = None


_logger = TensorBoardLogger()


@hookimpl
def ups_run_start(ctx: RunContext, config: Config) -> None:
    _logger.start(ctx, config.run_dir / "tensorboard")


@hookimpl
def ups_step_end(ctx: RunContext, step: int, metrics: Mapping[str, float]) -> None:
    _logger.scalars("train", step, metrics)


@hookimpl
def ups_eval_end(ctx: RunContext, step: int, metrics: Mapping[str, float]) -> None:
    _logger.scalars("eval", step, metrics)


@hookimpl
def ups_run_end(ctx: RunContext, result: TrainResult) -> None:
    _logger.close()


@hookimpl
def ups_error(ctx: RunContext, error: BaseException) -> None:
    _logger.close()
