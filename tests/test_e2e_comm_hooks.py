"""The bundled example trained with the comm hooks of ups-comm-hooks, on 2 and 4 real ranks.

``allreduce`` trains exactly as DDP's own all-reduce does (bit for bit); the compressing hooks
reach a loss within a stated tolerance of it while sending the bytes they promise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from ups.core import TrainResult, load_config, train
from ups.core.config._config import CommHookChoice
from ups.core.testing import assert_bitwise_equal, read_checkpoint

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pde_multitask.yaml"
STEPS = 48

HOOKS: dict[str, tuple[dict[str, Any], float]] = {
    "bf16": ({}, 1.05),
    "fp16": ({}, 1.05),
    "powersgd": ({"matrix_approximation_rank": 4, "start_powersgd_iter": 5}, 1.25),
    "batched_powersgd": ({"matrix_approximation_rank": 4, "start_powersgd_iter": 5}, 3.0),
    "topk": ({"ratio": 0.05, "start_iter": 5}, 2.0),
}
"""The compressing hooks: their options, and how many times plain all-reduce's final loss
theirs may be. Measured (torch 2.13, CPU, 2 and 4 ranks): bf16 and fp16 equal it to 4 digits;
PowerSGD rank 4 1.05 and 1.07 (rank 1, not tested: 1.43 and 1.63); batched PowerSGD rank 4,
which compresses a whole bucket as one matrix, 2.6 and 2.8; top-k of 5%, 1.75 and 1.75."""


def run(folder: Path, nproc: int, name: str, options: dict[str, Any] | None = None) -> TrainResult:
    """The example for :data:`STEPS` steps, reported every 8, with the hook ``name``; no
    evaluation, one checkpoint at the end."""
    config = load_config(
        EXAMPLE,
        [
            f"run.output_dir={folder / name}",
            "run.log_every=8",
            f"training.max_steps={STEPS}",
            f"checkpoint.every_steps={STEPS}",
            "sampler={name: torch}",  # as measured
        ],
    )
    config = attrs.evolve(
        config, eval=None, comm_hook=CommHookChoice(name=name, options=options or {})
    )
    return train(config, nproc=nproc)


def final_model(result: TrainResult) -> dict[str, torch.Tensor]:
    assert result.checkpoint is not None
    saved: dict[str, Any] = read_checkpoint(result.checkpoint)
    model: dict[str, torch.Tensor] = saved["state"]["model"]
    return model


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    nproc: int = request.param
    folder = tmp_path_factory.mktemp(f"ranks{nproc}")
    results = {name: run(folder, nproc, name) for name in ("none", "allreduce")}
    results |= {name: run(folder, nproc, name, options) for name, (options, _) in HOOKS.items()}
    return results


@pytest.mark.slow
def test_the_allreduce_hook_trains_exactly_as_ddp_without_a_hook(runs: Any) -> None:
    assert_bitwise_equal(final_model(runs["allreduce"]), final_model(runs["none"]), "model")
    assert runs["allreduce"].losses == runs["none"].losses


@pytest.mark.slow
@pytest.mark.parametrize("name", HOOKS)
def test_a_compressing_hook_trains_about_as_well_as_allreduce(runs: Any, name: str) -> None:
    plain, hooked = runs["allreduce"], runs[name]
    assert hooked.steps == STEPS
    assert hooked.losses[-1] < hooked.losses[0] / 1.5  # it learns
    assert hooked.losses[-1] <= plain.losses[-1] * HOOKS[name][1]
    assert not torch.equal(  # ... and it did compress
        final_model(hooked)["0.weight"], final_model(plain)["0.weight"]
    )


@pytest.mark.slow
def test_the_hooks_report_what_they_send(runs: Any) -> None:
    ratios = {name: [m["comm_ratio"] for m in r.metrics] for name, r in runs.items()}
    assert ratios["none"] == ratios["allreduce"] == [1.0] * (STEPS // 8)
    assert ratios["bf16"] == ratios["fp16"] == [0.5] * (STEPS // 8)
    # PowerSGD and top-k all-reduce plainly for their first 5 steps, then compress
    for name in ("powersgd", "batched_powersgd", "topk"):
        assert ratios[name][0] > 0.5 and max(ratios[name][1:]) < 0.5, name
