"""The loop's DDP maths on real processes: N ranks ≡ one process, accumulation ≡ a big batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ups.core import ConfigError, load_config, load_plugins, train
from ups.core.config._validate import TORCH_NAMES, validate
from ups.core.engine._optim import OPTIMIZERS, SCHEDULERS
from ups.core.testing import assert_params_close, read_checkpoint, tiny_project

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pde_multitask.py"


def final_params(folder: Path, nproc: int, **sections: dict[str, Any]) -> dict[str, torch.Tensor]:
    sections.setdefault("sampler", {"options": {"shuffle": False}})
    config = tiny_project(folder, **sections)
    result = train(config, nproc=nproc)
    assert result.checkpoint is not None
    return read_checkpoint(result.checkpoint)["state"]["model"]  # type: ignore[no-any-return]


@pytest.mark.slow
def test_two_ranks_of_batch_b_equal_one_process_of_batch_2b(tmp_path: Path) -> None:
    two = final_params(tmp_path / "a", 2, training={"batch_size": 4, "epochs": 2})
    one = final_params(tmp_path / "b", 1, training={"batch_size": 8, "epochs": 2})
    assert_params_close(two, one)


def test_accumulation_of_k_batches_equals_one_batch_of_k_b_with_clipping(tmp_path: Path) -> None:
    clip = {"grad_clip_norm": 0.5, "epochs": 2, "optimizer": "sgd", "lr": 0.1}
    accumulated = final_params(
        tmp_path / "a", 1, training={"batch_size": 4, "accumulation_steps": 4, **clip}
    )
    big = final_params(tmp_path / "b", 1, training={"batch_size": 16, **clip})
    assert_params_close(accumulated, big)
    untouched = final_params(
        tmp_path / "c", 1, training={"batch_size": 16, **clip, "grad_clip_norm": None}
    )
    with pytest.raises(AssertionError):
        assert_params_close(untouched, big)  # the clipping did something


@pytest.mark.slow
def test_accumulation_on_two_ranks_with_static_graph_equals_one_big_batch(tmp_path: Path) -> None:
    clip = {"grad_clip_norm": 0.5, "epochs": 2}
    ddp = final_params(
        tmp_path / "a",
        2,
        training={"batch_size": 2, "accumulation_steps": 4, **clip},
        distributed={"static_graph": True, "gradient_as_bucket_view": True},
    )
    one = final_params(tmp_path / "b", 1, training={"batch_size": 16, **clip})
    assert_params_close(ddp, one)


def test_an_uneven_last_group_is_averaged_over_its_own_micro_batches(tmp_path: Path) -> None:
    # 64 samples in batches of 8: 8 micro-batches, groups of 3, 3 and 2.
    accumulated = final_params(
        tmp_path / "a", 1, training={"batch_size": 8, "accumulation_steps": 3, "optimizer": "sgd"}
    )
    config = tiny_project(tmp_path / "b", training={"batch_size": 8, "accumulation_steps": 3})
    assert train(config).steps == 3
    assert accumulated["0.weight"].isfinite().all()


def test_per_task_losses_are_reported_with_the_task_names(tmp_path: Path) -> None:
    config = tiny_project(
        tmp_path,
        model={"factory": f"{EXAMPLE}:build_model", "options": {"grid": 16, "width": 32}},
        data={
            "factory": f"{EXAMPLE}:build_dataset",
            "options": {"samples_per_task": 32, "grid": 16},
            "tasks": ["advection", "diffusion", "burgers"],
        },
        training={"batch_size": 16, "epochs": 2},
        run={"log_every": 3},
    )
    result = train(config)
    first = result.metrics[0]
    assert {
        "loss",
        "loss/advection",
        "loss/diffusion",
        "loss/burgers",
        "lr",
        "samples",
    } <= first.keys()
    assert first["samples"] == 48
    per_task = [first[f"loss/{t}"] for t in ("advection", "diffusion", "burgers")]
    assert min(per_task) <= first["loss"] <= max(per_task)


def test_bf16_autocast_trains_on_cpu_and_a_scheduler_moves_the_lr(tmp_path: Path) -> None:
    config = tiny_project(
        tmp_path,
        training={
            "precision": "bf16",
            "epochs": 4,
            "scheduler": "StepLR",
            "scheduler_options": {"step_size": 8, "gamma": 0.5},
            "grad_clip_norm": 10.0,
        },
        run={"log_every": 8},
    )
    result = train(config)
    assert result.losses[-1] < result.losses[0]
    assert [m["lr"] for m in result.metrics] == pytest.approx([0.025, 0.0125, 0.00625, 0.003125])
    assert all(m["grad_norm"] > 0 for m in result.metrics)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.optimizer=adamv", "training.optimizer: unknown 'adamv'; allowed: a torch name"),
        ("training.scheduler=nope", "training.scheduler: unknown 'nope'"),
        ("training.precision=fp16", "training.precision: 'fp16' needs CUDA"),
    ],
)
def test_optimizer_scheduler_and_precision_are_validated(
    tmp_path: Path, override: str, message: str
) -> None:
    if "fp16" in override and torch.cuda.is_available():
        pytest.skip("this machine has CUDA, where fp16 is allowed")
    config = load_config(tiny_project(tmp_path), [override])
    with pytest.raises(ConfigError, match=message):
        validate(config, load_plugins(env={"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}))


def test_the_names_validate_knows_without_torch_are_torchs() -> None:
    assert {
        "training.optimizer": OPTIMIZERS.keys(),
        "training.scheduler": SCHEDULERS.keys(),
    } == TORCH_NAMES
