from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from ups.core import Config, ConfigError, RunContext, load_config, load_plugins
from ups.core.engine import train_rank
from ups.core.testing import run_ranks
from ups_blocks import plugin, sampler

NO_AUTOLOAD = {"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}


def test_selected_by_name_with_options() -> None:
    registry = load_plugins(extra=[("blocks", plugin)], env=NO_AUTOLOAD)
    record, options = registry.select("sampler", "blocks", {"repeats": 2}, "sampler")
    assert record.factory is sampler.block_sampler
    assert options == plugin.BlockOptions(repeats=2)


def test_a_bad_option_names_its_key() -> None:
    registry = load_plugins(extra=[("blocks", plugin)], env=NO_AUTOLOAD)
    with pytest.raises(ConfigError, match=r"^sampler\.options\.repeats: "):
        registry.select("sampler", "blocks", {"repeats": 0}, "sampler")


def test_the_installed_entry_point_is_found() -> None:
    registry = load_plugins(env={})
    assert registry.records("sampler")["blocks"].plugin == "blocks"


def test_listing_it_imports_no_torch() -> None:
    code = "import sys, ups_blocks.plugin as p; p.ups_samplers(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout == "False\n", result.stderr


def _indices(ctx: RunContext, size: int) -> list[int]:
    blocks = sampler.block_sampler(range(size), ctx=ctx, seed=0, options=plugin.BlockOptions())
    blocks.set_epoch(1)
    return sorted(blocks)


def test_ranks_get_equal_disjoint_blocks() -> None:
    first, second = run_ranks(_indices, 2, 11)
    assert first == list(range(0, 5))
    assert second == list(range(5, 10))


def make_data(n: int = 64) -> TensorDataset:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def _train(ctx: RunContext, config: Config) -> int:
    registry = load_plugins(extra=[("blocks", plugin)], env=NO_AUTOLOAD)
    return train_rank(config, ctx, registry).steps


def test_trains_on_two_ranks(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(
        f"""
        run: {{output_dir: {tmp_path}}}
        model: {{factory: "torch.nn:Linear", options: {{in_features: 4, out_features: 1}}}}
        data: {{factory: "{__file__}:make_data"}}
        training: {{batch_size: 8}}
        sampler: {{name: blocks, options: {{repeats: 2}}}}
        """
    )
    config = load_config(tmp_path / "run.yaml")
    # 64 samples, 32 a rank, twice per epoch, in batches of 8: 8 steps on each rank.
    assert run_ranks(_train, 2, config) == [8, 8]
