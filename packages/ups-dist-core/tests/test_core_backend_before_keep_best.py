"""A checkpoint backend written before keep-best (its ``save`` takes no ``metrics``) goes on
working: the engine passes ``metrics`` only to a backend whose options ask for the best."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ups.core import (
    CheckpointBackendPlugin,
    Loaded,
    RunContext,
    SimpleCheckpointer,
    SimpleCheckpointOptions,
    hookimpl,
    load_config,
    load_plugins,
)
from ups.core.engine import train_rank
from ups.core.testing import run_ranks, tiny_project

NO_AUTOLOAD = {"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}


class Older:
    """The ``Checkpointer`` protocol as it was: ``save`` without ``metrics``."""

    def __init__(self, *, ctx: RunContext, directory: Path, options: Any) -> None:
        self.inner = SimpleCheckpointer(
            ctx=ctx, directory=directory, options=SimpleCheckpointOptions()
        )

    def save(
        self,
        state: Mapping[str, Any],
        *,
        step: int,
        rank_state: Mapping[str, Any] | None = None,
    ) -> str:
        return self.inner.save(state, step=step, rank_state=rank_state)

    def load_latest(self) -> Loaded | None:
        return self.inner.load_latest()

    def wait(self) -> None:
        self.inner.wait()


class Backend:
    @hookimpl
    def ups_checkpoint_backends(self) -> list[CheckpointBackendPlugin]:
        # Older is the protocol as it was (no metrics), which today's protocol no longer types
        factory: Any = Older
        return [CheckpointBackendPlugin(name="older", description="before", factory=factory)]


def _train(ctx: RunContext, config: Path) -> int:
    registry = load_plugins(extra=[("older", Backend())], env=NO_AUTOLOAD)
    return train_rank(load_config(config), ctx, registry).steps


def test_a_backend_whose_save_takes_no_metrics_saves_and_resumes(tmp_path: Path) -> None:
    config = tiny_project(tmp_path, checkpoint={"name": "older", "every_steps": 2})
    assert run_ranks(_train, 2, config) == [4, 4]
    saved = sorted(p.name for p in (tmp_path / "runs" / "tiny" / "checkpoints").glob("step-*"))
    assert saved[-1] == "step-4", saved
