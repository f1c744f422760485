"""``ups check`` with every distribution installed: both bundled examples are exact on 2 ranks;
a lossy comm hook (ups-comm-hooks' ``bf16``) is run, reported and not failed on; several
breakers at once are each named."""

from __future__ import annotations

from pathlib import Path

import pytest

from ups.core.cli._main import main
from ups.core.testing import run_ups, tiny_project

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("examples/pde_operator/pde_operator.yaml", "examples/pde_multitask.yaml")

PLANTED = '''"""BatchNorm in the model, a 0-d mean in the step."""
import torch
from torch import nn

from ups.core import Step


def with_batchnorm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


class MeanStep(Step):
    def loss(self, outputs, batch):
        return ((outputs - batch[1]) ** 2).mean()
'''


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    """``ups check ARGS`` in this process: its exit status and the lines it printed."""
    capsys.readouterr()
    status = main(["check", *args])
    return status, capsys.readouterr().out.splitlines()


def cells(lines: list[str], first: str) -> list[str]:
    """The cells of the table row that starts with ``first``."""
    row = next(line for line in lines if line.startswith(f"{first}  "))
    return [cell.strip() for cell in row.removeprefix(first).split("  ") if cell.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES)
def test_the_examples_are_exact_on_two_ranks(example: str, tmp_path: Path) -> None:
    # In a scratch working directory: the operator example writes its data under ./data.
    run = run_ups("check", str(ROOT / example), "--nproc", "2", cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0] == f"ups check {ROOT / example}: 2 ranks, 5 steps, fp32 on cpu"
    for pair in ("A vs B", "A vs C", "B vs C"):
        assert cells(lines, pair)[1] == "yes"
    assert "breaks equivalence: nothing found" in lines
    assert lines[-1].startswith("exact to 1e-05: 2 ranks of batch ")
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["data"])  # no run folder


def test_a_lossy_comm_hook_is_reported_and_not_failed_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_project(tmp_path, comm_hook={"name": "bf16"})
    status, lines = check(capsys, str(config), "--nproc", "2", "--steps", "3")
    assert status == 0, lines
    assert cells(lines, "A") == ["2", "8", "1", "ddp", "none", cells(lines, "B")[-1]]
    assert cells(lines, "A+hook")[4] == "bf16"
    difference, verdict = cells(lines, "A+hook vs A")
    assert verdict == "reported only" and float(difference) > 1e-6  # bf16 rounds the gradients
    assert cells(lines, "A vs B")[1] == "yes"
    assert (
        "note: comm_hook 'bf16' is lossy: A ran with 'none', A+hook with 'bf16' (its "
        "difference is reported, not failed on)"
    ) in lines


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES)
@pytest.mark.parametrize("strategy", ["zero", "fsdp"])
def test_the_examples_are_exact_under_a_sharded_strategy_with_accumulation_and_clipping(
    example: str, strategy: str, tmp_path: Path
) -> None:
    """``zero`` and ``fsdp`` on 2 ranks = ``ddp`` on 2 ranks = 1 process, to 1e-5 in fp32,
    each example's own model, step and data, 2 micro-batches a step, clipped."""
    overrides = (f"strategy.name={strategy}", "training.accumulation_steps=2")
    clipped = (*overrides, "training.grad_clip_norm=0.5")
    args = [arg for override in clipped for arg in ("-o", override)]
    run = run_ups(
        "check",
        str(ROOT / example),
        "--nproc",
        "2",
        "--steps",
        "3",
        *args,
        cwd=tmp_path,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert cells(lines, "A")[3] == strategy and cells(lines, "A-ddp")[3] == "ddp"
    for pair in ("A vs A-ddp", "A vs B", "A vs C", "B vs C"):
        assert cells(lines, pair)[1] == "yes", run.stdout


@pytest.mark.parametrize("strategy", ["zero", "fsdp"])
def test_a_sharded_strategy_is_compared_with_ddp_on_the_same_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], strategy: str
) -> None:
    config = tiny_project(
        tmp_path,
        strategy={"name": strategy},
        training={"optimizer": "adamw", "accumulation_steps": 2, "grad_clip_norm": 0.5},
    )
    status, lines = check(capsys, str(config), "--nproc", "2", "--steps", "3")
    assert status == 0, lines
    assert cells(lines, "A")[:5] == ["2", "8", "2", strategy, "none"]
    assert cells(lines, "A-ddp")[:5] == ["2", "8", "2", "ddp", "none"]
    for pair in ("A vs A-ddp", "A vs B", "A vs C"):
        assert cells(lines, pair)[1] == "yes", lines


def test_a_mean_loss_and_batchnorm_are_both_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_project(
        tmp_path,
        model={"factory": "planted.py:with_batchnorm"},
        step={"factory": "planted.py:MeanStep"},
    )
    (tmp_path / "planted.py").write_text(PLANTED)
    status, lines = check(capsys, str(config), "--nproc", "2", "--steps", "2")
    assert status == 1, lines
    named = [line for line in lines if line.startswith("  - ")]
    assert [line.split(":")[0] for line in named] == [
        "  - BatchNorm (BatchNorm1d at 1)",
        "  - MeanStep.loss returns a 0-d mean without a count",
    ]
    assert lines[-1].endswith("; 2 things break it")
