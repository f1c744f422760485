"""ups-ckpt as a plugin: registration, options, retention rule, and the engine using it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ups.ckpt import InBackground, LocalCheckpointer, LocalCheckpointOptions
from ups.ckpt.plugin import local_backend
from ups.core import CheckpointBackendPlugin, ConfigError, RunContext, load_plugins
from ups.core.config._config import config_from_mapping
from ups.core.launch._processes import train_here


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def build_dataset(n: int = 32) -> torch.utils.data.TensorDataset:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))


def test_the_local_backend_is_registered_by_the_entry_point() -> None:
    registry = load_plugins(env={})
    provided = registry.records("checkpoint")["local"]
    assert provided.plugin == "ups-ckpt"
    assert isinstance(provided.record, CheckpointBackendPlugin)
    assert provided.record.factory is local_backend
    info = next(p for p in registry.plugins if p.name == "ups-ckpt")
    assert (info.distribution, info.status) == ("ups-ckpt", "enabled")


def test_options_are_checked_at_their_key_path() -> None:
    registry = load_plugins(env={})
    _, options = registry.select("checkpoint", "local", {"keep_last": 5}, "checkpoint")
    assert options == LocalCheckpointOptions(keep_last=5)
    with pytest.raises(ConfigError, match=r"checkpoint\.options\.keep_last: 0 is not allowed"):
        registry.select("checkpoint", "local", {"keep_last": 0}, "checkpoint")
    with pytest.raises(ConfigError, match=r"checkpoint\.options\.keep: unknown key"):
        registry.select("checkpoint", "local", {"keep": 1}, "checkpoint")


def test_async_save_wraps_the_backend_in_a_background_writer(tmp_path: Path) -> None:
    options = LocalCheckpointOptions(async_save=True)
    built = local_backend(ctx=RunContext(), directory=tmp_path, options=options)
    assert isinstance(built, InBackground)
    assert isinstance(built.inner, LocalCheckpointer)
    plain = local_backend(ctx=RunContext(), directory=tmp_path, options=LocalCheckpointOptions())
    assert isinstance(plain, LocalCheckpointer)


def test_the_engine_trains_and_checkpoints_with_it(tmp_path: Path) -> None:
    config = config_from_mapping(
        {
            "run": {"name": "tiny", "output_dir": str(tmp_path), "log_every": 2},
            "model": {"factory": f"{__file__}:build_model"},
            "data": {"factory": f"{__file__}:build_dataset"},
            "training": {"batch_size": 8, "epochs": 2, "max_steps": 6},
            "checkpoint": {"name": "local", "every_steps": 2, "options": {"keep_last": 2}},
        }
    )
    result = train_here(RunContext(), config)
    folder = tmp_path / "tiny" / "checkpoints"
    assert result.checkpoint == str(folder / "step-6")
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-4", "step-6"]
    ckpt = LocalCheckpointer(
        ctx=RunContext(), directory=tmp_path / "tiny", options=LocalCheckpointOptions()
    )
    loaded = ckpt.load_latest()
    assert loaded is not None
    assert loaded.step == 6 and loaded.state["step"] == 6
    assert set(loaded.state["model"]) == {"weight", "bias"}
    assert loaded.rank_state is not None and set(loaded.rank_state["rng"]) >= {"torch", "numpy"}


def test_loading_the_plugin_does_not_import_torch_dcp() -> None:
    """torch.distributed.checkpoint takes half a second to import: only ``sharded`` needs it."""
    code = "import sys, ups.ckpt.plugin; print('torch.distributed.checkpoint' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
