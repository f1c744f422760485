"""``ups tune`` on the device: the search runs into real CUDA out-of-memory errors and settles on
a batch size that trains; and a run's throughput report on CUDA: ``mfu`` against
``training.peak_flops``, with the profiler's trace of the GPU's kernels."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from gpu_runs import events, ups

from ups.core.testing import tiny_project

pytestmark = pytest.mark.gpu

WIDE = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset


class Wide(nn.Module):
    """A compute-bound model that says how many FLOPs a sample costs (forward and backward)."""

    def __init__(self, features, width):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(features, width), nn.Tanh(), nn.Linear(width, 1))
        self.flops_per_sample = 6 * sum(p.numel() for p in self.parameters())

    def forward(self, x):
        return self.net(x)


def build_model(features=4, width=8):
    return Wide(features, width)


def build_dataset(n=64, features=4):
    x = torch.randn(n, features, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, x.sum(dim=1, keepdim=True))
'''


def project(folder: Path, features: int, width: int, samples: int, **training: object) -> Path:
    config = tiny_project(
        folder,
        model={"factory": "wide.py:build_model", "options": {"features": features, "width": width}},
        data={"factory": "wide.py:build_dataset", "options": {"n": samples, "features": features}},
        training=training,
    )
    (folder / "wide.py").write_text(WIDE)
    return config


def test_tune_finds_a_batch_size_that_fits_past_a_real_oom(tmp_path: Path) -> None:
    # A sample holds about 3 float32 tensors of `width` at the peak of its step (the hidden
    # layer, its gradient, the gradient before tanh): a batch of 5000 or so fills the device,
    # 8192 cannot fit; the data holds 16384, so the search must run out of memory.
    total = torch.cuda.get_device_properties(0).total_memory
    width = total // (4096 * 16)
    config = project(tmp_path, 4, width, 16384)
    tuned = ups("tune", str(config), "--nproc", "1", cwd=tmp_path)
    trials = events(tuned, "batch size trial")
    assert any(not t["fits"] for t in trials), trials  # a real out-of-memory error was met
    match = re.search(r"training.batch_size: (\d+) fits on every rank", tuned.stdout)
    assert match is not None, tuned.stdout
    size = int(match.group(1))
    assert 1 < size < 16384
    assert max(t["batch_size"] for t in trials if t["fits"]) == size
    assert min(t["batch_size"] for t in trials if not t["fits"]) == size + 1
    trained = ups(
        *("train", str(config), "-o", f"training.batch_size={size}"),
        *("-o", "training.max_steps=2"),
        cwd=tmp_path,
    )
    assert [e["steps"] for e in events(trained, "done")] == [2]


def matmul_flops() -> float:
    """The float32 FLOP/s this device reaches on a large matrix product: the peak to measure
    the model's utilisation against."""
    a = torch.randn(8192, 8192, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start, repeats = time.perf_counter(), 20
    for _ in range(repeats):
        a @ a
    torch.cuda.synchronize()
    return 2 * 8192**3 * repeats / (time.perf_counter() - start)


def test_reports_carry_mfu_against_peak_flops_and_the_profile_traces_the_gpu(
    tmp_path: Path,
) -> None:
    peak = matmul_flops()
    config = project(tmp_path, 1024, 8192, 256 * 64, batch_size=256, peak_flops=peak, max_steps=60)
    result = ups("train", str(config), "--profile", "3", "-o", "run.log_every=20", cwd=tmp_path)
    reports = events(result, "step")
    assert len(reports) == 3
    for report in reports:
        assert 0 < report["mfu"] < 1.1, report
        assert report["mfu"] == pytest.approx(report["tflops"] * 1e12 / peak, rel=1e-2)
    profile = tmp_path / "runs" / "tiny" / "profile"
    trace = json.loads((profile / "rank0.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])  # the GPU's kernels
    comm = json.loads((profile / "comm.json").read_text())
    assert comm["summary"]["peak_memory_mb"] > 0
