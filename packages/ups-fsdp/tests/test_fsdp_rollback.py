"""The guard's rollback under ``zero`` and ``fsdp`` on real gloo ranks: each rank's snapshot
holds its own shard (the optimizer's under ``zero``, the parameters' and the optimizer's under
``fsdp``), taken and put back with no collective, and a NaN planted on one rank rolls every
rank back: the run ends bitwise equal to the same run passing over that step through the
quarantine, as under ``ddp`` (ups-dist-core's test_core_rollback.py, whose project this is)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from core_tests import core_tests

from ups.core import RunContext
from ups.core.engine._faults import ENV
from ups.core.testing import run_ranks

rollback = core_tests("test_core_rollback")


def ended(ctx: RunContext, config_path: Path) -> dict[str, Any]:
    """The rollback tests' run on this rank (here, for the ranks' processes to import)."""
    result: dict[str, Any] = rollback.ended(ctx, config_path)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero", "fsdp"])
def test_a_rollback_under_a_sharded_strategy_ends_bitwise_as_the_quarantined_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    guard = {"action": "rollback", "snapshot_every": 2}
    sections = {"strategy": strategy, "optimizer": "adamw"}
    monkeypatch.setenv(ENV, "nan@1:4")
    rolled = run_ranks(
        ended,
        2,
        rollback.project(tmp_path / "rolled", guard, **sections),
    )
    monkeypatch.delenv(ENV)
    run_dir = tmp_path / "rolled" / "runs" / "tiny"
    (record,) = map(json.loads, (run_dir / "guard.jsonl").read_text().splitlines())
    assert (record["step"], record["batches"]) == (4, [4, 4])
    assert rolled[0]["metrics"][-1]["guard_rollbacks"] == 1
    quarantine = {**guard, "action": "skip", "quarantine": str(run_dir / "guard.jsonl")}
    passed = run_ranks(ended, 2, rollback.project(tmp_path / "passed", quarantine, **sections))
    for found, expected in zip(rolled, passed, strict=True):
        rollback.assert_same_end(found, expected)
