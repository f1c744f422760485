"""The ``tensorboard`` plugin: a logger through the lifecycle hooks.

Rank 0 alone writes, into one TensorBoard run per training run, ``RUN_DIR/tensorboard``: every
training report (``ups_step_end``) and every evaluation (``ups_eval_end``) as scalars at their
optimizer step. The tags group them:

- ``train/NAME``: the training loss, the loss of each task (``train/loss/TASK``), ``lr``, ...
- ``comm/NAME``: the bytes of gradient communication per step (``comm_bytes``,
  ``allreduce_bytes``) and their ratio;
- ``throughput/NAME``: ``samples_per_s``, ``tokens_per_s``, ``tflops``, ``mfu``, ``step_time_s``;
- ``eval/NAME``: the evaluation's loss and each task's.

Every bad step the training guard records (``training.guard``, ``ups_guard_record``) is the
text ``guard`` at its step: a Markdown line of the step, its batches, the action and the
reason, and a table of each rank's finiteness, tasks and sample indices.

Installing the distribution enables it for every run; ``UPS_BLOCK_PLUGINS=tensorboard``
disables it.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

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


GUARD_TAG = "guard"
"""The text tag of the guard's records."""


def record_markdown(record: Mapping[str, Any]) -> str:
    """A guard record (``ups_guard_record``) as TensorBoard's text shows it: one line, then a
    table of the ranks."""
    first, last = record["batches"]
    batches = f"batch {first}" if first == last else f"batches {first}-{last}"
    lines = [
        f"**step {record['step']}** ({record['action']}): {record['reason']}; "
        f"epoch {record['epoch']}, {batches} of each rank's share",
        "",
        "| rank | finite | tasks | indices |",
        "|---|---|---|---|",
    ]
    for rank in record["ranks"]:
        tasks = ", ".join(rank["tasks"])
        indices = ", ".join(map(str, rank["indices"]))
        lines.append(f"| {rank['rank']} | {rank['finite']} | {tasks} | {indices} |")
    return "\n".join(lines)


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
        self.held: list[Mapping[str, Any]] = []
        """Guard records handed before the first report, written once it opens the file."""

    def start(self, ctx: RunContext, folder: Path) -> None:
        """Write the run's events in ``folder`` (rank 0), from its first report on."""
        self.held = []
        if ctx.is_main:
            self.folder = folder
            log.info("tensorboard", logdir=str(folder))

    def scalars(
        self, kind: Literal["train", "eval"], step: int, metrics: Mapping[str, float]
    ) -> None:
        """Write one report's metrics at ``step``; NaN (a loss not measured) is left out."""
        writer = self._open(step)
        if writer is None:
            return
        for name, value in metrics.items():
            if not math.isnan(value):
                writer.add_scalar(tag(kind, name), value, global_step=step)

    def guard(self, record: Mapping[str, Any]) -> None:
        """Write a guard record as the text ``guard`` at its step; held until the first
        report opens the file (its purge step)."""
        if self.folder is None:
            return
        if self.writer is None:
            self.held.append(record)
            return
        self.writer.add_text(GUARD_TAG, record_markdown(record), global_step=record["step"])

    def close(self) -> None:
        """Flush and close the event file (opened first for the guard records still held)."""
        if self.held:
            self._open(self.held[0]["step"])
        if self.writer is not None:
            self.writer.close()
        self.writer = self.folder = None

    def _open(self, step: int) -> SummaryWriter | None:
        """The event file, opened at the first report (``step``), purging from there; the
        guard records held written into it. ``None`` on the other ranks."""
        if self.writer is None and self.folder is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.folder), purge_step=step)
            held, self.held = self.held, []
            for record in held:
                self.guard(record)
        return self.writer


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
def ups_guard_record(ctx: RunContext, record: Mapping[str, Any]) -> None:
    _logger.guard(record)


@hookimpl
def ups_run_end(ctx: RunContext, result: TrainResult) -> None:
    _logger.close()


@hookimpl
def ups_error(ctx: RunContext, error: BaseException) -> None:
    _logger.close()
