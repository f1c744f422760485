"""``ups check`` on real processes (gloo on CPU): the tiny project is exact on 2 ranks; each
planted breaker of the equivalence is named with its fix and fails the check; a batch of
``W·b`` that does not fit falls back to accumulation; usage mistakes are one line, exit 2."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ups.core import load_config, load_plugins
from ups.core.cli._check import examine, without_dropout
from ups.core.testing import install_plugin, run_ups, tiny_project

Result = subprocess.CompletedProcess[str]

PLANTED = '''"""The tiny model and step with what breaks W ranks = one process planted in them."""
import torch
from torch import nn

from ups.core import Step


def with_batchnorm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


def with_dropout():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 1))


class Attention(nn.Module):
    """Dropout inside attention, and noise drawn in the forward pass."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, dropout=0.1, batch_first=True)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        x = x[:, None, :] + 0.1 * torch.randn_like(x[:, None, :])
        return self.out(self.attention(x, x, x)[0][:, 0])


def with_attention():
    return Attention()


class MeanStep(Step):
    """The built-in step's loss, averaged into a 0-d mean without a count."""

    def loss(self, outputs, batch):
        return ((outputs - batch[1]) ** 2).mean()


class Limited(nn.Module):
    """Runs out of memory on a batch larger than ``limit``."""

    def __init__(self, limit):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.limit = limit

    def forward(self, x):
        if len(x) > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory: {len(x)} > {self.limit}")
        return self.inner(x)
'''

HALVES = '''"""A sampler whose ranks take contiguous halves of the data: not world_invariant."""
from torch.utils.data import Sampler

from ups.core import SamplerPlugin, hookimpl


class Halves(Sampler):
    def __init__(self, dataset, *, ctx, seed, options):
        share = len(dataset) // ctx.world_size
        self.indices = range(ctx.rank * share, (ctx.rank + 1) * share)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


@hookimpl
def ups_samplers():
    return [SamplerPlugin(name="halves", factory=Halves, even=True)]
'''


def planted(folder: Path, **sections: Any) -> Path:
    """The tiny project in ``folder`` with ``planted.py`` beside it; its config's path."""
    config = tiny_project(folder, **sections)
    (folder / "planted.py").write_text(PLANTED)
    return config


def rows(stdout: str) -> dict[str, list[str]]:
    """The report's table rows by their first cell (``A``, ``A vs B``, ...), cells split."""
    found = {}
    for line in stdout.splitlines():
        cells = line.split("  ")
        cells = [c.strip() for c in cells if c.strip()]
        if cells:
            found[cells[0]] = cells[1:]
    return found


def breakers(stdout: str) -> list[str]:
    """The report's breakers, each with its fix: ``what | fix``."""
    lines = stdout.splitlines()
    return [
        f"{line[4:]} | {lines[i + 1].strip().removeprefix('fix: ')}"
        for i, line in enumerate(lines)
        if line.startswith("  - ")
    ]


def test_the_tiny_project_is_exact_on_two_ranks_in_fp32(
    tmp_path: Path, ups: Callable[..., Result]
) -> None:
    config = tiny_project(tmp_path, training={"precision": "bf16"})
    result = ups("check", str(config), "--nproc", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    table = rows(result.stdout)
    assert table["A"] == ["2", "8", "1", "ddp", "none", table["B"][-1]]
    assert table["B"][:5] == ["1", "16", "1", "-", "-"] and table["C"][:5] == [
        "1",
        "8",
        "2",
        "-",
        "-",
    ]
    assert "A-ddp" not in table  # under ddp, A is the DDP run
    for pair in ("A vs B", "A vs C", "B vs C"):
        assert float(table[pair][0]) < 1e-6 and table[pair][1] == "yes"
    lines = result.stdout.splitlines()
    assert lines[0] == f"ups check {config}: 2 ranks, 5 steps, fp32 on cpu"
    assert "loss per sample: yes (Step.loss: one loss per sample)" in lines
    assert "breaks equivalence: nothing found" in lines
    assert "note: ran in fp32, not training.precision bf16 (--keep-precision keeps it)" in lines
    assert lines[-1] == (
        "exact to 1e-05: 2 ranks of batch 8 train as 1 process of batch 16, and 2 "
        "micro-batches of 8 as 1 of 16"
    )
    assert not (tmp_path / "runs").exists()  # the run's own folder is never touched


def test_batchnorm_is_named_with_its_fix_and_breaks_the_comparisons(
    tmp_path: Path, ups: Callable[..., Result]
) -> None:
    config = planted(tmp_path, model={"factory": "planted.py:with_batchnorm"})
    result = ups("check", str(config), "--nproc", "2", "--steps", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    assert breakers(result.stdout) == [
        "BatchNorm (BatchNorm1d at 1): statistics per rank and per micro-batch | GroupNorm or "
        "LayerNorm (DDP refuses SyncBatchNorm on CPU)"
    ]
    table = rows(result.stdout)
    assert table["A vs B"][1] == table["A vs C"][1] == table["B vs C"][1] == "no"
    assert result.stdout.splitlines()[-1].endswith("; 1 thing breaks it")


def test_dropout_is_named_and_the_runs_compare_without_it(
    tmp_path: Path, ups: Callable[..., Result]
) -> None:
    config = planted(tmp_path, model={"factory": "planted.py:with_dropout"})
    result = ups("check", str(config), "--nproc", "2", "--steps", "3")
    assert result.returncode == 1, result.stdout + result.stderr
    assert breakers(result.stdout) == [
        "Dropout (Dropout at 1): draws different masks per rank (every rank from the same "
        "seed, each for its own part of the batch) | none, if masks drawn otherwise will do; "
        "the runs set p=0, so the comparisons above prove the rest"
    ]
    table = rows(result.stdout)
    assert table["A vs B"][1] == table["A vs C"][1] == table["B vs C"][1] == "yes"
    assert result.stdout.splitlines()[-1] == "not exact: 1 thing breaks it"


def test_a_mean_loss_without_a_count_is_named_and_differs_with_uneven_micro_batches(
    tmp_path: Path, ups: Callable[..., Result]
) -> None:
    # 60 samples: the first epoch's last step is 6 samples a rank, C's micro-batches 8 and 4.
    config = planted(tmp_path, step={"factory": "planted.py:MeanStep"}, data={"options": {"n": 60}})
    result = ups("check", str(config), "--nproc", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "loss per sample: no (MeanStep.loss: a 0-d mean without a count)" in result.stdout
    assert breakers(result.stdout) == [
        "MeanStep.loss returns a 0-d mean without a count: uneven micro-batches (an epoch's "
        "last) weigh each micro-batch alike, not each sample | return one loss per sample, or "
        "(mean, count)"
    ]
    table = rows(result.stdout)
    assert table["A vs C"][1] == "no" and float(table["A vs C"][0]) > 1e-4


@pytest.mark.slow
def test_a_sampler_that_is_not_world_invariant_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, "ups-halves", "ups_halves_plugin", HALVES)
    monkeypatch.setenv("PYTHONPATH", str(site))  # the ranks find it as an installed plugin
    monkeypatch.delenv("UPS_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    config = tiny_project(tmp_path / "project", sampler={"name": "halves"})
    result = run_ups("check", str(config), "--nproc", "2", "--steps", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    assert breakers(result.stdout) == [
        "sampler 'halves' does not declare world_invariant: its global batch may depend on the "
        "number of ranks | a sampler that declares it (torch, tensor, multitask), or "
        "world_invariant=True in its plugin's record if W ranks of b take the samples of 1 "
        "process of W*b"
    ]
    table = rows(result.stdout)
    assert table["A vs B"][1] == "no" and table["B vs C"][1] == "yes"


def test_one_process_of_the_whole_batch_out_of_memory_leaves_c_as_the_reference(
    tmp_path: Path, ups: Callable[..., Result]
) -> None:
    model = {"factory": "planted.py:Limited", "options": {"limit": 8}}
    config = planted(tmp_path, model=model)
    result = ups("check", str(config), "--nproc", "2", "--steps", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    table = rows(result.stdout)
    assert "B" not in table and "A vs B" not in table
    assert table["A vs C"][1] == "yes"
    assert (
        "note: B (1 process x 16) ran out of memory: left out; C, accumulation on one process, "
        "is the reference" in result.stdout
    )


def test_examine_turns_off_dropout_in_attention_and_names_randomness_in_the_forward(
    tmp_path: Path,
) -> None:
    config = load_config(planted(tmp_path, model={"factory": "planted.py:with_attention"}))
    findings = examine(config, load_plugins())
    assert findings.dropout and findings.loss == "samples"
    assert [b.what for b in findings.breakers] == [
        "Dropout (MultiheadAttention at attention): draws different masks per rank (every rank "
        "from the same seed, each for its own part of the batch)",
        "the forward pass (Step.forward) draws random numbers in training, dropout modules "
        "aside: every rank draws the same ones for its own part of the batch",
    ]
    model = without_dropout(config.model.factory, {})
    assert model.attention.dropout == 0.0
    torch.manual_seed(0)
    assert model(torch.randn(3, 4)).shape == (3, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "1"], "--nproc: must be >= 2: one process has nothing to compare"),
        (["--steps", "0"], "argument --steps: must be >= 1, not 0"),
        (["--tolerance", "0"], "argument --tolerance: must be > 0, not 0"),
        (["--tolerance", "x"], "argument --tolerance: must be a number > 0, not 'x'"),
        (["-o", "training.batch_size=0"], "training.batch_size: 0 is not allowed: must be >= 1"),
        (["-o", "sampler.name=torhc"], "; did you mean 'torch'?"),
    ],
)
def test_usage_mistakes_are_one_line_and_exit_2(
    tmp_path: Path, ups: Callable[..., Result], args: list[str], message: str
) -> None:
    config = tiny_project(tmp_path)
    result = ups("check", str(config), *args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1].startswith("ups: error: ")
    assert result.stderr.strip().endswith(message)
