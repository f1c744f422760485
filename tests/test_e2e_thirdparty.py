"""A third-party plugin distribution, made here, is discovered, listed and selectable; a broken
one is reported, not a crash."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from ups.core.testing import events, install_plugin, run_ups

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = '''
"""Samples a rank's share of the dataset in reverse order."""
from collections.abc import Iterator

import attrs
from torch.utils.data import Sampler

from ups.core import SamplerPlugin, hookimpl


@attrs.frozen
class ReverseOptions:
    offset: int = 0


class ReverseSampler(Sampler[int]):
    def __init__(self, size: int, rank: int, world: int, offset: int) -> None:
        self.indices = list(range(size))[rank::world][::-1][offset:]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def reverse(dataset, *, ctx, seed, options):
    return ReverseSampler(len(dataset), ctx.rank, ctx.world_size, options.offset)


@hookimpl
def ups_samplers():
    return [SamplerPlugin(name="reverse", factory=reverse, options=ReverseOptions,
                          description="a rank's share, last first")]
'''


@pytest.fixture
def site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, "ups-reverse", "ups_reverse", PLUGIN, "1.2")
    install_plugin(
        site, "ups-broken", "ups_broken", "raise RuntimeError('half-installed')\n", "1.2"
    )
    return site


def ups(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``ups ARGS`` with the plugins installed in ``site`` on its path."""
    return run_ups(*args, cwd=cwd, env={"PYTHONPATH": str(site)}, timeout=300)


def test_plugins_lists_the_third_party_plugin_and_the_broken_one(
    site: Path, tmp_path: Path
) -> None:
    result = ups(site, "plugins", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = [line.split(None, 5) for line in result.stdout.splitlines()]
    assert ["sampler", "reverse", "ups-reverse", "ups-reverse", "1.2"] in [r[:5] for r in rows]
    broken = next(r for r in rows if r[2] == "ups-broken")
    assert broken[5] == "failed: RuntimeError: half-installed"
    warnings = [json.loads(line) for line in result.stderr.splitlines()]
    assert warnings[0]["event"] == "plugin failed to load; skipped"


def config(tmp_path: Path, sampler: str) -> Path:
    (tmp_path / "run.yaml").write_text(
        textwrap.dedent(f"""\
        run: {{name: reverse, output_dir: {tmp_path / "runs"}, log_every: 1}}
        model: {{factory: {ROOT / "examples" / "pde_multitask.py"}:build_model}}
        data: {{factory: {ROOT / "examples" / "pde_multitask.py"}:build_dataset,
                options: {{samples_per_task: 16}}}}
        training: {{epochs: 1, batch_size: 8}}
        sampler: {sampler}
        """)
    )
    return tmp_path / "run.yaml"


def test_the_third_party_sampler_is_selectable_and_trains_on_two_ranks(
    site: Path, tmp_path: Path
) -> None:
    path = config(tmp_path, "{name: reverse, options: {offset: 1}}")
    assert ups(site, "validate", str(path), cwd=tmp_path).returncode == 0
    result = ups(site, "train", str(path), "--nproc", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # 48 samples, 24 a rank, offset 1 drops one: 23 samples in batches of 8 = 3 steps
    assert [e["steps"] for e in events(result.stderr, "done")] == [3]


def test_a_bad_option_of_the_third_party_plugin_is_a_usage_error(
    site: Path, tmp_path: Path
) -> None:
    result = ups(
        site,
        "validate",
        str(config(tmp_path, "{name: reverse, options: {ofset: 1}}")),
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "ups: error: sampler.options.ofset: unknown key; allowed: offset; did you mean 'offset'?"
    )


def test_selecting_a_name_nobody_provides_lists_the_available_and_the_broken(
    site: Path, tmp_path: Path
) -> None:
    result = ups(site, "validate", str(config(tmp_path, "{name: balanced}")), cwd=tmp_path)
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("ups: error: sampler.name: unknown sampler 'balanced'; available: ")
    assert "reverse" in line and "torch" in line
    assert (
        "plugin 'ups-broken' (ups-broken 1.2) failed to load: RuntimeError: half-installed" in line
    )
