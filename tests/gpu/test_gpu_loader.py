"""``data.loader.pin_memory`` and non-blocking copies with loader workers, on CUDA: batches come
out of the workers in pinned memory, and training on them (asynchronous copies) ends bitwise
equal to training on pageable batches read in the process (synchronous copies); the profiler's
trace shows the copies from pinned memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gpu_runs import MULTITASK, checkpoint, events, ups

from ups.core import RunContext, load_config, load_plugins
from ups.core.engine._run import Run
from ups.core.testing import assert_bitwise_equal

pytestmark = pytest.mark.gpu

WORKERS = ["data.loader.num_workers=2", "data.loader.persistent_workers=true"]


# Python 3.12+ warns when it forks a process with threads (torch's); the workers only read.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_workers_hand_over_pinned_batches_by_default_on_cuda(tmp_path: Path) -> None:
    config = load_config(MULTITASK, [f"run.output_dir={tmp_path}", *WORKERS])
    assert config.data.loader.pin_memory is None  # the default: on with CUDA
    run = Run(config, RunContext(device=torch.device("cuda", 0)), load_plugins())
    assert run.loader.pin_memory and run.loader.num_workers == 2
    inputs, targets, tasks = next(iter(run.loader))
    assert inputs.is_pinned() and targets.is_pinned() and tasks.is_pinned()


def test_asynchronous_copies_from_pinned_workers_train_like_synchronous_ones(
    tmp_path: Path,
) -> None:
    def train(name: str, *loader: str) -> tuple[dict[str, object], set[str]]:
        """The final checkpoint of 20 steps, and the names of the host-to-device copies the
        profiler saw in 2 of them (the profile trains nothing: it times passes, no update)."""
        folder = tmp_path / name
        folder.mkdir()
        result = ups(
            *("train", str(MULTITASK), "--nproc", "1", "-o", f"run.output_dir={folder}"),
            *("-o", "training.max_steps=20", "-o", "eval=null", "--profile", "2"),
            *(arg for option in loader for arg in ("-o", option)),
            cwd=folder,
            deterministic=True,
        )
        assert [e["device"] for e in events(result, "training")] == ["cuda:0"]
        run = folder / "pde-multitask"
        trace = json.loads((run / "profile" / "rank0.json").read_text())["traceEvents"]
        copies = {e["name"] for e in trace if e.get("name", "").startswith("Memcpy HtoD")}
        return checkpoint(run, 20), copies

    pinned, pinned_copies = train("pinned", *WORKERS, "data.loader.pin_memory=true")
    pageable, pageable_copies = train(
        "pageable", "data.loader.num_workers=0", "data.loader.pin_memory=false"
    )
    assert "Memcpy HtoD (Pinned -> Device)" in pinned_copies
    assert "Memcpy HtoD (Pinned -> Device)" not in pageable_copies
    for key in ("model", "optimizer", "step", "epoch_left"):
        assert_bitwise_equal(pinned[key], pageable[key], key)
