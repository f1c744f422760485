"""A multi-task neural operator in the shape of seed 001: one FNO learns three 2-D PDEs.

The data is PDEBench's layout, one HDF5 file per task (``generate.py`` writes them the first
time, on every rank at once, safely). The three tasks are one family of equations on the
periodic square, ``u_t + cx u_x + cy u_y + beta u (u_x + u_y) = nu (u_xx + u_yy)``, and each
sample carries its coefficients ``params = (nu, cx, cy, beta)``: heat (``diffusion``),
linear transport (``advection``) and viscous ``burgers``. The model maps ``(u0, params)`` to
the solution at ``t = 1``.

What it shows of ups:

- **Lazy HDF5 reading in worker processes.** :class:`H5Task` opens its file on the first read
  in each process and never pickles the handle, so every ``DataLoader`` worker has its own.
- **Dict batches and a model of two inputs.** Items are dicts; :class:`OperatorStep` (the
  ``step`` section) says how a batch calls the model, what its loss is (the relative L2 error,
  per sample, as neural-operator papers train) and where the task ids are.
- **Per-task reporting.** The ``multitask`` sampler of ups-samplers mixes the tasks; ups
  reports ``loss/<task>`` and the per-sample metric ``nrmse/<task>`` (PDEBench's nRMSE).

    pip install h5py ./packages/ups-dist-core ./packages/ups-samplers
    ups train examples/pde_operator/pde_operator.yaml --nproc 2
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import h5py
import torch
from torch import nn
from torch.utils.data import ConcatDataset, Dataset

from ups.core import Step

TASKS = ("diffusion", "advection", "burgers")
PARAMS = 4  # (nu, cx, cy, beta)

Item = dict[str, torch.Tensor]


def _generate() -> ModuleType:
    """``generate.py`` beside this file, imported by path (this folder is not on sys.path)."""
    name = "ups_example_pde_operator_generate"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("generate.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


class H5Task(Dataset[Item]):
    """One task's PDEBench-style file, read lazily: ``u0 = tensor[i, 0]``, ``u_t = tensor[i, -1]``.

    The file is opened on the first ``__getitem__`` of each process (reopened when the process
    id changes, as in a forked worker) and dropped when pickled, so every ``DataLoader`` worker
    reads through a handle of its own.
    """

    def __init__(self, path: str | os.PathLike[str], task_id: int) -> None:
        self.path = Path(path)
        self.task_id = task_id
        with h5py.File(self.path, "r") as f:
            self._length = int(f["tensor"].shape[0])
        self._file: h5py.File | None = None
        self._pid: int | None = None

    def __len__(self) -> int:
        return self._length

    def _handle(self) -> h5py.File:
        if self._file is None or self._pid != os.getpid():
            self._file, self._pid = h5py.File(self.path, "r"), os.getpid()
        return self._file

    def __getitem__(self, index: int) -> Item:
        if not -self._length <= index < self._length:
            raise IndexError(f"index {index} out of range for {self._length} samples")
        index %= self._length
        f = self._handle()
        frames = torch.from_numpy(f["tensor"][index])  # [T, X, Y]
        return {
            "u0": frames[:1].clone(),
            "params": torch.from_numpy(f["params"][index]),
            "u_t": frames[-1:].clone(),
            "task": torch.tensor(self.task_id, dtype=torch.int64),
        }

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"] = state["_pid"] = None
        return state


def build_dataset(
    root: str | os.PathLike[str] = "data/pde_operator",
    tasks: Sequence[str] = TASKS,
    samples_per_task: int = 256,
    seed: int = 0,
) -> ConcatDataset[Item]:
    """One :class:`H5Task` per task (ids in the order of ``tasks``), generated into ``root``
    (relative to the working directory) if missing, concatenated."""
    paths = _generate().ensure_data(root, samples_per_task, seed, tasks)
    return ConcatDataset([H5Task(path, task_id) for task_id, path in enumerate(paths)])


class SpectralConv2d(nn.Module):
    """Multiply the lowest ``modes x modes`` Fourier modes (both corners of ``rfft2``'s
    half-plane) by learnt complex matrices, drop the rest: FNO's global convolution."""

    def __init__(self, channels: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        # real and imaginary parts in a last dimension of 2: real parameters, for DDP and hooks
        self.weight = nn.Parameter(torch.rand(2, channels, channels, modes, modes, 2) / channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, size = self.modes, x.shape[-2:]
        if 2 * m > size[0] or m > size[1] // 2 + 1:
            raise ValueError(f"{m} modes do not fit a {size[0]}x{size[1]} grid")
        x_hat = torch.fft.rfft2(x.float())
        weight = torch.view_as_complex(self.weight)
        out = torch.zeros_like(x_hat)
        out[..., :m, :m] = torch.einsum("bixy,ioxy->boxy", x_hat[..., :m, :m], weight[0])
        out[..., -m:, :m] = torch.einsum("bixy,ioxy->boxy", x_hat[..., -m:, :m], weight[1])
        return torch.fft.irfft2(out, s=size)


class FNO2d(nn.Module):
    """A small Fourier neural operator: ``(u0 [B,1,X,Y], params [B,P]) -> u(t=1) [B,1,X,Y]``.

    The lift sees ``u0``, the parameters broadcast over the grid and the grid's coordinates;
    each layer adds a spectral convolution to a pointwise one; the output is added to ``u0``.
    """

    def __init__(self, params: int = PARAMS, width: int = 20, modes: int = 8, layers: int = 3):
        super().__init__()
        self.lift = nn.Conv2d(1 + params + 2, width, 1)
        self.spectral = nn.ModuleList(SpectralConv2d(width, modes) for _ in range(layers))
        self.pointwise = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(layers))
        self.project = nn.Sequential(
            nn.Conv2d(width, 2 * width, 1), nn.GELU(), nn.Conv2d(2 * width, 1, 1)
        )

    def forward(self, u0: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        batch, _, nx, ny = u0.shape
        axes = [torch.arange(n, device=u0.device, dtype=u0.dtype) / n for n in (nx, ny)]
        grid = torch.stack(torch.meshgrid(*axes, indexing="ij")).expand(batch, -1, -1, -1)
        fields = params.to(u0.dtype)[:, :, None, None].expand(-1, -1, nx, ny)
        h = self.lift(torch.cat([u0, fields, grid], dim=1))
        for i, (spectral, pointwise) in enumerate(zip(self.spectral, self.pointwise, strict=True)):
            h = spectral(h) + pointwise(h)
            if i < len(self.spectral) - 1:
                h = nn.functional.gelu(h)
        return u0 + self.project(h)


def build_model(width: int = 20, modes: int = 8, layers: int = 3, params: int = PARAMS) -> FNO2d:
    """The :class:`FNO2d` of the config's ``model.options``."""
    return FNO2d(params=params, width=width, modes=modes, layers=layers)


def relative_l2(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``||pred - target||_2 / ||target||_2`` of each sample: shape ``[B]``."""
    error = (pred.float() - target.float()).flatten(1).norm(dim=1)
    return error / target.float().flatten(1).norm(dim=1).clamp_min(1e-12)


def nrmse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """PDEBench's nRMSE of each sample: the RMSE of the error over the RMSE of the target, per
    channel over the grid, averaged over channels; shape ``[B]``. With one channel it equals
    :func:`relative_l2`."""
    error = (pred.float() - target.float()).pow(2).flatten(2).mean(dim=2)
    return (error / target.float().pow(2).flatten(2).mean(dim=2).clamp_min(1e-24)).sqrt().mean(1)


class OperatorStep(Step):
    """How a dict batch trains :class:`FNO2d`: ``model(u0, params)`` against ``u_t``."""

    task = "task"

    def forward(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return model(batch["u0"], batch["params"])

    def loss(self, outputs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return relative_l2(outputs, batch["u_t"])

    def metrics(
        self, outputs: torch.Tensor, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Per sample (reported overall and per task): ``nrmse`` and the plain ``rmse``."""
        error = (outputs.float() - batch["u_t"].float()).pow(2).flatten(1).mean(dim=1).sqrt()
        return {"nrmse": nrmse(outputs, batch["u_t"]), "rmse": error}
