"""The ``bf16`` and ``fp16`` hooks through the plugin contract: the registry and a config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ups.comm_hooks import CompressionHook, HookOptions, plugin
from ups.core import CommHookPlugin, ConfigError, load_plugins, train
from ups.core.testing import tiny_project


def test_the_entry_point_registers_both_hooks() -> None:
    registry = load_plugins()
    records = registry.records("comm_hook")
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        record = registry.get("comm_hook", name, "comm_hook.name")  # imported when selected
        assert records[name].plugin == "ups-comm-hooks"
        assert isinstance(record, CommHookPlugin)
        assert record.factory == CompressionHook(dtype)
        assert record.options is HookOptions
    info = next(p for p in registry.plugins if p.name == "ups-comm-hooks")
    assert (info.distribution, info.status) == ("ups-comm-hooks", "enabled")


def test_the_hooks_take_no_options() -> None:
    registry = load_plugins(
        extra=[("ups-comm-hooks", plugin)], env={"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}
    )
    with pytest.raises(ConfigError, match=r"comm_hook\.options\.ratio.*unknown key"):
        registry.select("comm_hook", "bf16", {"ratio": 2}, "comm_hook")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "ratio"), [("bf16", 0.5), ("allreduce", 1.0)])
def test_a_config_trains_and_reports_the_bytes_it_sent(
    tmp_path: Path, name: str, ratio: float
) -> None:
    config = tiny_project(
        tmp_path,
        run={"log_every": 4},
        model={"options": {"width": 16}},
        training={"epochs": 4, "lr": 0.01},
        distributed={"backend": "gloo"},
        comm_hook={"name": name, "options": {"profile": True}},
    )
    result = train(config, nproc=2)
    assert result.steps == 16
    assert result.losses[-1] < result.losses[0] / 2
    params = 4 * 16 + 16 + 16 + 1  # Linear(4, 16), Tanh, Linear(16, 1)
    for metrics in result.metrics:
        assert metrics["allreduce_bytes"] == params * 4
        assert metrics["comm_bytes"] == params * 4 * ratio
        assert metrics["comm_ratio"] == ratio
        # one bucket (the model is tiny), timed
        assert metrics["comm_b0_bytes"] == metrics["comm_bytes"]
        assert 0 < metrics["comm_b0_s"] == metrics["comm_s"]
