"""The neural-operator example (examples/pde_operator): its data, dataset and model, then
short runs of ``ups train --nproc 2`` on it: one that trains, and one killed mid-epoch with
loader workers on that resumes bitwise."""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import h5py
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ups.core.testing import assert_bitwise_equal, events, read_checkpoint, run_ups

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pde_operator"
TASKS = ("diffusion", "advection", "burgers")


def _load(name: str, path: Path) -> ModuleType:
    """Import ``path`` as ``name``, as ``ups`` imports a config's ``file.py:callable``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so pickle finds H5Task's class
    spec.loader.exec_module(module)
    return module


generate = _load("pde_operator_example_generate", EXAMPLE / "generate.py")
op = _load("pde_operator_example", EXAMPLE / "fno.py")


def test_files_have_pdebench_datasets_and_shapes(tmp_path: Path) -> None:
    paths = generate.ensure_data(tmp_path, 8, 0)
    assert [p.name for p in paths] == [f"2D_{t}_N8_seed0.h5" for t in TASKS]
    for task, path in zip(TASKS, paths, strict=True):
        with h5py.File(path, "r") as f:
            assert f["tensor"].shape == (8, len(generate.TIMES), 32, 32)
            assert f["tensor"].dtype == "float32"
            assert f["x-coordinate"].shape == f["y-coordinate"].shape == (32,)
            assert f["t-coordinate"].shape == (len(generate.TIMES),)
            assert f["params"].shape == (8, 4) and f["params"].dtype == "float32"
            assert list(f["params"].attrs["names"]) == ["nu", "cx", "cy", "beta"]
            assert f.attrs["task"] == task
            tensor = torch.from_numpy(f["tensor"][:])
            assert torch.isfinite(tensor).all() and tensor[:, 0].abs().amax() > 0.1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)


def test_generation_is_deterministic_for_a_seed() -> None:
    for task in TASKS:
        first, second = generate.generate(task, 4, 3), generate.generate(task, 4, 3)
        assert all((a == b).all() for a, b in zip(first, second, strict=True))
        assert not (generate.generate(task, 4, 4)[0] == first[0]).all()


def test_diffusion_and_advection_are_exact() -> None:
    tensor, params = generate.generate("diffusion", 4, 0)
    assert (tensor[:, -1] ** 2).sum() < (tensor[:, 0] ** 2).sum()  # heat decays
    tensor, params = generate.generate("advection", 4, 0)
    energy = (tensor**2).sum(axis=(2, 3))  # a shift keeps every moment
    assert abs(energy - energy[:, :1]).max() < 1e-3 * energy.max()
    assert (params[:, 0] == 0).all() and (params[:, 3] == 0).all()


def test_ensure_data_is_idempotent(tmp_path: Path) -> None:
    paths = generate.ensure_data(tmp_path, 4, 0)
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert generate.ensure_data(tmp_path, 4, 0) == paths
    assert [p.stat().st_mtime_ns for p in paths] == stamps
    assert len(generate.ensure_data(tmp_path, 4, 1)) == 3  # another seed: files of its own
    assert len(list(tmp_path.iterdir())) == 6


def test_concurrent_writers_leave_whole_files(tmp_path: Path) -> None:
    """Three processes generate into one folder at once (as ranks do), through the CLI."""
    command = [sys.executable, str(EXAMPLE / "generate.py"), str(tmp_path), "--samples", "64"]
    writers = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [w.communicate(timeout=120)[0] for w in writers]
    assert [w.returncode for w in writers] == [0, 0, 0]
    assert len(set(outputs)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"2D_{t}_N64_seed0.h5" for t in TASKS
    )  # no temporary file left
    for task, path in zip(TASKS, generate.ensure_data(tmp_path, 64, 0), strict=True):
        with h5py.File(path, "r") as f:
            assert (f["tensor"][:] == generate.generate(task, 64, 0)[0]).all()


@pytest.fixture
def dataset(tmp_path: Path) -> Any:
    return op.build_dataset(root=tmp_path, samples_per_task=8, seed=0)


def test_items_are_dicts_of_the_first_and_last_frames(dataset: Any) -> None:
    assert len(dataset) == 24 and [len(d) for d in dataset.datasets] == [8, 8, 8]
    item = dataset[9]  # advection's second sample
    assert item.keys() == {"u0", "params", "u_t", "task"}
    assert item["u0"].shape == item["u_t"].shape == (1, 32, 32)
    assert item["params"].shape == (4,)
    assert item["task"].shape == () and item["task"].dtype == torch.int64 and item["task"] == 1
    assert all(item[k].dtype == torch.float32 for k in ("u0", "params", "u_t"))
    with h5py.File(dataset.datasets[1].path, "r") as f:
        assert (item["u0"][0].numpy() == f["tensor"][1, 0]).all()
        assert (item["u_t"][0].numpy() == f["tensor"][1, -1]).all()
        assert (item["params"].numpy() == f["params"][1]).all()
    with pytest.raises(IndexError):
        dataset.datasets[0][8]


def test_a_task_pickles_without_its_handle(dataset: Any) -> None:
    task = dataset.datasets[2]
    item = task[3]  # opens the file in this process
    assert task._file is not None
    state = pickle.dumps(task)
    copy = pickle.loads(state)
    assert copy._file is None and task._file is not None
    again = copy[3]
    assert all(torch.equal(item[k], again[k]) for k in item)
    assert copy._file is not None and copy._file is not task._file  # a handle of its own


class _Probe(Dataset[dict[str, torch.Tensor]]):
    """The example's dataset, each item telling which process read it, through whose handle."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = self.dataset[index]
        task = item["task"].item()
        part = self.dataset.datasets[task]
        return item | {"pid": torch.tensor(os.getpid()), "handle_pid": torch.tensor(part._pid)}


# Python 3.12+ warns when it forks a process with threads (torch's); the workers only read.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_every_loader_worker_reads_through_its_own_handle(dataset: Any) -> None:
    expected = default_collate([dataset[i] for i in range(len(dataset))])  # opens them here
    loader = DataLoader(_Probe(dataset), batch_size=4, num_workers=2)
    batches = list(loader)
    pids = torch.cat([b["pid"] for b in batches])
    assert (pids == torch.cat([b["handle_pid"] for b in batches])).all()
    assert len(set(pids.tolist())) == 2 and os.getpid() not in pids.tolist()
    for key in ("u0", "params", "u_t", "task"):
        assert torch.equal(torch.cat([b[key] for b in batches]), expected[key])
    assert torch.equal(dataset[23]["u_t"], expected["u_t"][23])  # this process's handles still read


def test_the_fno_maps_a_field_and_parameters_to_a_field() -> None:
    model = op.build_model(width=8, modes=4, layers=2)
    u0, params = torch.randn(3, 1, 32, 32), torch.randn(3, 4)
    out = model(u0, params)
    assert out.shape == (3, 1, 32, 32)
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model(torch.randn(2, 1, 16, 16), torch.randn(2, 4)).shape == (2, 1, 16, 16)
    with pytest.raises(ValueError, match="do not fit"):
        model(torch.randn(2, 1, 6, 6), torch.randn(2, 4))


def test_relative_l2_is_per_sample() -> None:
    target = torch.randn(5, 1, 8, 8)
    assert op.relative_l2(target, target).shape == (5,)
    assert (op.relative_l2(target, target) == 0).all()
    assert torch.allclose(op.relative_l2(torch.zeros_like(target), target), torch.ones(5))
    pred = target.clone()
    pred[2] *= 1.5  # only the third sample is off, by half its norm
    assert torch.allclose(op.relative_l2(pred, target), torch.tensor([0, 0, 0.5, 0, 0]))
    assert torch.allclose(op.nrmse(pred, target), op.relative_l2(pred, target))


def test_the_step_calls_the_model_with_two_inputs(dataset: Any) -> None:
    batch = default_collate([dataset[i] for i in (0, 9, 17)])
    step = op.OperatorStep()
    outputs = step.forward(op.build_model(width=8, modes=4, layers=2), batch)
    assert outputs.shape == (3, 1, 32, 32)
    assert step.loss(outputs, batch).shape == (3,)
    assert step.task_ids(batch).tolist() == [0, 1, 2]
    metrics = step.metrics(outputs, batch)
    assert {name: m.shape for name, m in metrics.items()} == {"nrmse": (3,), "rmse": (3,)}


@pytest.mark.slow
def test_the_example_trains_on_two_ranks_with_per_task_metrics(tmp_path: Path) -> None:
    result = run_ups(
        *("train", str(EXAMPLE / "pde_operator.yaml"), "--nproc", "2"),
        *("-o", f"run.output_dir={tmp_path}", "-o", "training.max_steps=30"),
        *("-o", f"data.options.root={tmp_path / 'data'}"),
        *("-o", f"eval.options.root={tmp_path / 'data'}"),
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    logged = events(result.stderr)
    steps = [e for e in logged if e["event"] == "step"]
    assert [e["step"] for e in steps] == [10, 20, 30]
    for task in TASKS:
        assert all(e[f"loss/{task}"] > 0 and e[f"nrmse/{task}"] > 0 for e in steps)
    assert steps[-1]["loss"] < 0.8 * steps[0]["loss"]
    (last,) = [e for e in logged if e["event"] == "eval"]  # at the end only (every 40 steps)
    assert last["val_samples"] == 192 and all(f"val_nrmse/{t}" in last for t in TASKS)
    # the config's EMA of the weights, evaluated beside them, per task too
    assert all(f"val_loss_ema/{t}" in last and f"val_nrmse_ema/{t}" in last for t in TASKS)
    assert last["val_loss_ema"] != last["val_loss"] and "val_samples_ema" not in last
    done = [e for e in logged if e["event"] == "done"]
    assert len(done) == 1 and done[0]["steps"] == 30
    assert len(list((tmp_path / "data").glob("2D_*.h5"))) == 6


def operator_run(
    folder: Path, data: Path, *args: str, faults: str = ""
) -> subprocess.CompletedProcess[str]:
    """``ups train`` of the example for 40 steps (an epoch is 24) on 2 ranks with 2 loader
    workers each, saving every 15 steps (mid-epoch), into ``folder``."""
    return run_ups(
        *("train", str(EXAMPLE / "pde_operator.yaml"), "--nproc", "2", *args),
        *("-o", f"run.output_dir={folder}", "-o", "training.max_steps=40"),
        *("-o", "checkpoint.every_steps=15", "-o", "eval.every_steps=1000"),
        *("-o", f"data.options.root={data}", "-o", f"eval.options.root={data}"),
        cwd=folder,
        env={"UPS_FAULTS": faults},
        timeout=300,
    )


@pytest.mark.slow
def test_killed_mid_epoch_with_workers_it_resumes_bitwise_and_reports_per_task(
    tmp_path: Path,
) -> None:
    data, plain, killed = tmp_path / "data", tmp_path / "plain", tmp_path / "killed"
    plain.mkdir(), killed.mkdir()
    reference = operator_run(plain, data)
    assert reference.returncode == 0, reference.stderr[-3000:]
    # rank 1 killed (SIGKILL) in step 33: the job restarts and resumes from step 30, the
    # 6th step of epoch 2, with the multitask sampler's state and 2 workers per rank
    done = operator_run(killed, data, "--max-restarts", "1", faults="kill@1:33")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [e["step"] for e in events(done.stderr, "fault injected")] == [33]
    assert [e["step"] for e in events(done.stderr, "resumed")] == [30]

    def final(folder: Path) -> Any:
        return read_checkpoint(folder / "pde-operator" / "checkpoints" / "step-40")["state"]

    found, expected = final(killed), final(plain)
    for key in ("model", "optimizer", "scheduler", "sampler", "step", "epoch", "rng"):
        assert_bitwise_equal(found[key], expected[key], key)
    assert expected["epoch_left"] > 0  # it ended mid-epoch 2 too

    report = run_ups("report", str(killed / "pde-operator"))
    assert report.returncode == 0, report.stderr
    for task in TASKS:
        assert f"train loss/{task}" in report.stdout and f"train nrmse/{task}" in report.stdout
    assert (killed / "pde-operator" / "report.png").stat().st_size > 0
