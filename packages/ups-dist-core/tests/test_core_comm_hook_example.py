"""docs/hooks.md's example comm hook (``mean-allreduce``), taken from the page as written, on
two real ranks: it trains as DDP's own all-reduce does, and reports the bytes it sent."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any

from ups.core import RunContext, load_config, load_plugins
from ups.core.engine import train_rank
from ups.core.testing import assert_params_close, read_checkpoint, run_ranks, tiny_project

HOOKS_MD = Path(__file__).resolve().parents[3] / "docs" / "hooks.md"
NO_AUTOLOAD = {"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}


def example() -> types.ModuleType:
    """The python block of hooks.md that defines ``mean_allreduce``, as a plugin module."""
    blocks = re.findall(r"^```python\n(.*?)^```$", HOOKS_MD.read_text(), re.MULTILINE | re.DOTALL)
    [code] = [block for block in blocks if "def mean_allreduce(" in block]
    module = types.ModuleType("mean_allreduce_example")
    exec(compile(code, f"{HOOKS_MD}:mean_allreduce", "exec"), module.__dict__)
    return module


def _train(ctx: RunContext, config: Path) -> tuple[str | None, list[dict[str, float]]]:
    registry = load_plugins(extra=[("example", example())], env=NO_AUTOLOAD)
    result = train_rank(load_config(config), ctx, registry)
    return result.checkpoint, list(result.metrics)


def final(folder: Path, hook: str) -> tuple[dict[str, Any], list[dict[str, float]]]:
    config = tiny_project(folder, comm_hook={"name": hook}, training={"epochs": 2})
    (checkpoint, metrics), _ = run_ranks(_train, 2, config)
    assert checkpoint is not None
    return read_checkpoint(checkpoint)["state"]["model"], metrics


def test_the_documented_mean_allreduce_trains_as_ddp_does_and_counts_its_bytes(
    tmp_path: Path,
) -> None:
    ours, reports = final(tmp_path / "ours", "mean-allreduce")
    ddp, _ = final(tmp_path / "ddp", "none")
    assert_params_close(ours, ddp)
    assert reports and all(r["comm_bytes"] == r["allreduce_bytes"] > 0 for r in reports)
