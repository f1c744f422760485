"""``checkpoint.resume: latest``: a run stopped and resumed ends where an unstopped one does."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from ups.core import ConfigError, Manifest, UsageError, checksum, train
from ups.core.testing import (
    assert_bitwise_equal,
    install_plugin,
    read_checkpoint,
    run_ups,
    tiny_project,
)

DROPOUT_MODEL = """
import torch
from torch import nn


def build_model(width=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Dropout(0.3), nn.Tanh(), nn.Linear(width, 1))
"""


def project(
    folder: Path,
    max_steps: int,
    resume: str,
    sampler: str = "torch",
    backend: str = "simple",
    model: str = DROPOUT_MODEL,
    model_options: dict[str, Any] | None = None,
    comm_hook: dict[str, Any] | None = None,
    loader: dict[str, Any] | None = None,
    **training: Any,
) -> Path:
    """The tiny project with a dropout model (the RNG matters), 64 samples in batches of 4 on
    2 ranks: 8 steps an epoch (fewer with accumulation), 3 epochs, checkpoints every 3 steps.
    ``model``: the source of the model's module (``build_model(**model_options)``)."""
    sections: dict[str, Any] = {"comm_hook": comm_hook} if comm_hook else {}
    if loader:
        sections["data"] = {"loader": loader}
    config = tiny_project(
        folder,
        model={"factory": "drop.py:build_model", "options": model_options or {}},
        training={"epochs": 3, "batch_size": 4, "max_steps": max_steps, **training},
        sampler={"name": sampler},
        checkpoint={
            "name": backend,
            "every_steps": 3,
            "resume": resume,
            "options": {"keep_last": 5},
        },
        **sections,
    )
    (folder / "drop.py").write_text(model)
    return config


def final_state(result: Any) -> dict[str, Any]:
    """The replicated state of the run's final checkpoint, with every rank's own state as a
    list under ``ranks``."""
    assert result.checkpoint is not None
    saved = read_checkpoint(result.checkpoint)
    return {**saved["state"], "ranks": saved["ranks"]}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop_at", "sampler", "backend", "training"),
    [
        (
            5,
            "torch",
            "simple",
            {},
        ),  # mid-epoch: torch's sampler has no state, its epoch is replayed
        (8, "torch", "simple", {}),  # at an epoch's end
        (3, "torch", "simple", {"accumulation_steps": 3}),  # mid-way through an epoch's 3 groups
        (5, "tensor", "simple", {}),  # mid-epoch: the sampler's state continues the epoch
        (2, "tensor", "local", {"accumulation_steps": 2}),  # ups-ckpt's backend
    ],
)
def test_a_stopped_and_resumed_run_ends_bitwise_equal_to_an_unstopped_one(
    tmp_path: Path, stop_at: int, sampler: str, backend: str, training: dict[str, Any]
) -> None:
    def run(folder: str, steps: int, resume: str) -> Any:
        config = project(tmp_path / folder, steps, resume, sampler, backend, **training)
        return train(config, nproc=2)

    whole = run("whole", 14, "none")
    assert run("parts", stop_at, "latest").steps == stop_at
    rest = run("parts", 14, "latest")
    assert (rest.steps, rest.epochs) == (whole.steps, whole.epochs)
    a, b = final_state(whole), final_state(rest)
    for key in ("model", "optimizer", "step", "epoch", "epoch_left", "rng", "ranks"):
        assert_bitwise_equal(a[key], b[key])
    # The reports after the first one (whose window began at the stop) are the same too.
    assert rest.losses[1:] == whole.losses[-len(rest.losses) + 1 :]


CONTRACT_SAMPLER = '''
"""A sampler written from docs/hooks.md's ups_samplers contract alone."""
import math

import torch

from ups.core import SamplerPlugin, hookimpl


class Dealt(torch.utils.data.Sampler):
    """The epoch's permutation dealt round-robin over the ranks. Its state: the epoch and the
    samples of it taken over all ranks, which any number of ranks continues from."""

    def __init__(self, dataset, *, ctx, seed, options):
        self.size, self.ranks, self.rank, self.seed = len(dataset), ctx.world_size, ctx.rank, seed
        self.epoch = self.start = self.yielded = 0

    def set_epoch(self, epoch):
        if epoch != self.epoch:
            self.start = 0
        self.epoch = epoch

    def __len__(self):
        return math.ceil((self.size - self.start) / self.ranks)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator).tolist()[self.start :]
        order += order[: len(self) * self.ranks - len(order)]  # the same count on every rank
        self.yielded = 0
        for index in order[self.rank :: self.ranks]:
            self.yielded += 1
            yield index

    def state_dict(self):
        return {"epoch": self.epoch, "taken": min(self.size, self.start + self.yielded * self.ranks)}

    def load_state_dict(self, state):
        self.epoch, self.start, self.yielded = int(state["epoch"]), int(state["taken"]), 0


@hookimpl
def ups_samplers():
    return [SamplerPlugin(name="dealt", factory=Dealt)]
'''


@pytest.mark.slow
def test_a_sampler_written_from_the_contract_resumes_bitwise_with_workers_and_on_one_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/hooks.md's sampler contract, followed by a third party's sampler: stopped
    mid-epoch (step 5 of 8, 2 loader workers reading ahead) and resumed on 2 ranks, the run
    ends bitwise where an unstopped one does; resumed on 1 rank, the 24 samples left of the
    epoch make 6 steps."""
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, "ups-dealt", "ups_dealt", CONTRACT_SAMPLER)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    )

    def run(folder: str, steps: int, nproc: int = 2) -> Any:
        workers = {"num_workers": 2, "persistent_workers": True}  # no fork at the epoch's start
        config = project(tmp_path / folder, steps, "latest", "dealt", loader=workers)
        return train(config, nproc=nproc)

    whole = run("whole", 14)
    assert run("parts", 5).steps == 5
    shutil.copytree(tmp_path / "parts", tmp_path / "one")
    rest = run("parts", 14)
    assert (rest.steps, rest.epochs) == (whole.steps, whole.epochs)
    a, b = final_state(whole), final_state(rest)
    for key in ("model", "optimizer", "step", "epoch", "epoch_left", "sampler", "rng", "ranks"):
        assert_bitwise_equal(a[key], b[key])
    one = run("one", 12, nproc=1)  # the epoch's 6 steps left, then the next epoch's first
    assert (one.steps, one.epochs) == (12, 2)


@pytest.mark.slow
def test_powersgd_error_feedback_is_saved_per_rank_and_resumed_exactly(tmp_path: Path) -> None:
    """pytorch/pytorch#75666: PowerSGD's error feedback and warm-start matrices are each
    rank's own; a resumed run that lost them would drift from the unstopped one."""
    hook = {
        "name": "powersgd",
        "options": {
            "matrix_approximation_rank": 1,
            "start_powersgd_iter": 2,
            "min_compression_rate": 0.5,
        },
    }

    def run(folder: str, steps: int) -> Any:
        config = project(tmp_path / folder, steps, "latest", "tensor", "local", comm_hook=hook)
        return train(config, nproc=2)

    whole = run("whole", 14)
    assert run("parts", 5).steps == 5
    rest = run("parts", 14)
    a, b = final_state(whole), final_state(rest)
    errors = [own["comm_hook"]["error_dict"] for own in a["ranks"]]
    assert errors[0] and not all(torch.equal(errors[0][i], errors[1][i]) for i in errors[0])
    for key in ("model", "optimizer", "step", "ranks"):
        assert_bitwise_equal(a[key], b[key])


@pytest.mark.slow
def test_resume_latest_without_a_checkpoint_starts_afresh(tmp_path: Path) -> None:
    result = train(project(tmp_path, 4, "latest"), nproc=2)
    assert result.steps == 4


@pytest.mark.slow
@pytest.mark.parametrize(("sampler", "steps"), [("tensor", 5 + 6 + 16 + 16), ("torch", 5 + 3 * 16)])
def test_resuming_on_another_number_of_ranks_deals_the_rest_of_the_epoch(
    tmp_path: Path, sampler: str, steps: int
) -> None:
    """Stopped at step 5 of 8 on 2 ranks (40 of 64 samples taken), resumed on 1 rank (batches
    of 4): the tensor sampler deals the 24 left, 6 steps, then 2 epochs of 16; torch's,
    without a state, starts the epoch over."""
    assert train(project(tmp_path, 5, "latest", sampler), nproc=2).steps == 5
    result = train(project(tmp_path, 100, "latest", sampler), nproc=1)
    assert (result.steps, result.epochs) == (steps, 3)


@pytest.mark.slow
def test_a_resume_with_another_seed_is_refused_unless_allowed(tmp_path: Path) -> None:
    config = project(tmp_path, 4, "latest")
    assert run_ups("train", str(config)).returncode == 0
    refused = run_ups("train", str(config), "-o", "run.seed=7", "-o", "training.max_steps=6")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "ups: error: checkpoint.resume: the checkpoint of step 4 was saved with seed 0, this "
        "run has 7; start afresh (checkpoint.resume: none), or accept it with "
        "--allow-changed seed"
    )
    allowed = run_ups(
        "train",
        str(config),
        "-o",
        "run.seed=7",
        "-o",
        "training.max_steps=6",
        "--allow-changed",
        "seed",
    )
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert '"event": "resumed"' in allowed.stderr


@pytest.mark.slow
def test_on_two_ranks_a_refused_resume_is_a_usage_error_too(tmp_path: Path) -> None:
    config = project(tmp_path, 4, "latest")
    assert run_ups("train", str(config), "--nproc", "2").returncode == 0
    refused = run_ups("train", str(config), "--nproc", "2", "-o", "training.accumulation_steps=2")
    assert refused.returncode == 2, refused.stderr[-3000:]
    # every rank refuses it alike; the launcher says it once, for the first rank that exited
    # with it (the agent may stop the other before it does)
    said = re.findall(
        r"ups: rank [01] failed: ConfigError: checkpoint\.resume: the checkpoint of step 4 was "
        r"saved with accumulation_steps 1, this run has 2;",
        refused.stderr,
    )
    assert len(said) == 1, refused.stderr[-3000:]


@pytest.mark.slow
def test_a_resume_on_other_data_or_from_another_format_is_refused(tmp_path: Path) -> None:
    result = train(project(tmp_path, 4, "latest"), nproc=1)
    assert result.steps == 4 and result.checkpoint is not None
    with pytest.raises(ConfigError, match=r"saved with dataset \[64\], this run has \[60\]"):
        train(project(tmp_path, 6, "latest"), nproc=1, overrides=["data.options.n=60"])
    # A checkpoint of an older layout (before the state had a format) is named, not misread.
    folder = Path(result.checkpoint)
    saved = torch.load(folder / "state.pt", weights_only=True)
    del saved["format"]
    torch.save(saved, folder / "state.pt")
    manifest = Manifest.from_json((folder / "COMMIT").read_text())
    with open(folder / "state.pt", "rb") as file:  # committed as it is now: not damage
        files = {**manifest.files, "state.pt": checksum(file)}
    (folder / "COMMIT").write_text(attrs.evolve(manifest, files=files).to_json())
    with pytest.raises(UsageError) as info:
        train(project(tmp_path, 6, "latest"), nproc=1)
    assert str(info.value) == (
        f"checkpoint {result.checkpoint}: its training state has format None (saved by "
        f"{', '.join(f'{k} {v}' for k, v in sorted(saved['versions'].items()))}), "
        "this ups-dist-core reads format 1; resume it with the version that saved it, or start "
        "afresh (checkpoint.resume: none)"
    )


FINGERPRINTED_DATA = """
import torch


class Fingerprinted(torch.utils.data.TensorDataset):
    fingerprint = ""


def build_dataset(n=64, fingerprint="v1"):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    data = Fingerprinted(x, x.sum(dim=1, keepdim=True))
    data.fingerprint = fingerprint
    return data
"""


@pytest.mark.slow
def test_a_resume_on_data_with_another_fingerprint_is_refused(tmp_path: Path) -> None:
    """Same size, other content: the dataset's own fingerprint tells them apart."""
    (tmp_path / "fp.py").write_text(FINGERPRINTED_DATA)
    data = ["data.factory=fp.py:build_dataset"]
    assert train(project(tmp_path, 4, "latest"), nproc=1, overrides=data).steps == 4
    changed = [*data, "data.options.fingerprint=v2"]
    with pytest.raises(
        ConfigError, match=r"saved with dataset \[64, 'v1'\], this run has \[64, 'v2'\]"
    ):
        train(project(tmp_path, 6, "latest"), nproc=1, overrides=changed)
    accepted = [*changed, "checkpoint.allow_changed=[dataset]"]
    assert train(project(tmp_path, 6, "latest"), nproc=1, overrides=accepted).steps == 6


@pytest.mark.slow
def test_a_comm_hook_state_resumes_only_into_the_hook_that_saved_it(tmp_path: Path) -> None:
    """Another PowerSGD rank cannot take the saved matrices: a usage error naming the option.
    Another hook starts its own state afresh, with a warning."""
    hook = {"name": "powersgd", "options": {"start_powersgd_iter": 2, "min_compression_rate": 0.5}}
    config = project(tmp_path, 4, "latest", comm_hook=hook)
    assert run_ups("train", str(config), "--nproc", "2").returncode == 0
    ranked = ["-o", "comm_hook.options.matrix_approximation_rank=1"]
    refused = run_ups("train", str(config), "--nproc", "2", "-o", "training.max_steps=6", *ranked)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert (
        "ConfigError: comm_hook.options: cannot resume the checkpoint: the PowerSGD state was "
        "saved with matrix_approximation_rank 2, not 1 as now" in refused.stderr
    )
    other = ["-o", "comm_hook.name=topk", "-o", "comm_hook.options={}"]
    switched = run_ups("train", str(config), "--nproc", "2", "-o", "training.max_steps=6", *other)
    assert switched.returncode == 0, switched.stderr[-3000:]
    assert "state was saved by 'powersgd', not by 'topk' as now" in switched.stderr
    assert '"event": "resumed"' in switched.stderr
