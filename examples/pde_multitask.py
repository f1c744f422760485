"""A small multi-task problem in the spirit of seed 001: learn three 1-D PDE solution operators.

Each sample is an initial condition ``u0`` on a periodic grid (a random sum of sines) plus a
one-hot task code; the target is the solution at ``t = T`` of one of three equations:

- ``advection``: ``u_t + c u_x = 0``, solved exactly (a shift);
- ``diffusion``: ``u_t = nu u_xx``, solved exactly (each mode decays as ``exp(-nu k^2 T)``);
- ``burgers``: ``u_t + u u_x = nu u_xx``, integrated with small explicit steps.

The data is generated on the fly from a fixed seed, so every rank builds the same dataset.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import ConcatDataset, TensorDataset

TASKS = ("advection", "diffusion", "burgers")
T_END = 0.5


def _initial_conditions(n: int, grid: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.linspace(0, 2 * math.pi, grid + 1)[:-1]
    k = torch.arange(1, 4, dtype=torch.float32)
    amplitude = (torch.rand(n, 3, generator=generator) * 2 - 1) / k
    phase = torch.rand(n, 3, generator=generator) * 2 * math.pi
    return x, k, amplitude, phase


def _solve(
    task: str, n: int, grid: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    x, k, a, phi = _initial_conditions(n, grid, generator)
    modes = lambda shift, decay: (  # noqa: E731 - sum_k a_k decay_k sin(k (x - shift) + phi_k)
        a[:, :, None]
        * decay[None, :, None]
        * torch.sin(k[None, :, None] * (x[None, None, :] - shift) + phi[:, :, None])
    ).sum(dim=1)
    u0 = modes(0.0, torch.ones(3))
    if task == "advection":
        return u0, modes(1.0 * T_END, torch.ones(3))
    if task == "diffusion":
        return u0, modes(0.0, torch.exp(-0.1 * k**2 * T_END))
    if task == "burgers":
        nu, dt, dx = 0.05, 0.005, 2 * math.pi / grid
        u = u0.clone()
        for _ in range(round(T_END / dt)):
            ux = (torch.roll(u, -1, 1) - torch.roll(u, 1, 1)) / (2 * dx)
            uxx = (torch.roll(u, -1, 1) - 2 * u + torch.roll(u, 1, 1)) / dx**2
            u = u + dt * (nu * uxx - u * ux)
        return u0, u
    raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")


def build_dataset(
    tasks: list[str] | tuple[str, ...] = TASKS,
    samples_per_task: int = 512,
    grid: int = 64,
    seed: int = 0,
) -> ConcatDataset[tuple[torch.Tensor, ...]]:
    """One ``TensorDataset`` of ``(u0 + task code, u(T), task id)`` per task, concatenated."""
    generator = torch.Generator().manual_seed(seed)
    parts = []
    for task_id, task in enumerate(tasks):
        u0, u_end = _solve(task, samples_per_task, grid, generator)
        code = nn.functional.one_hot(torch.full((samples_per_task,), task_id), len(tasks)).float()
        ids = torch.full((samples_per_task,), task_id)
        parts.append(TensorDataset(torch.cat([u0, code], dim=1), u_end, ids))
    return ConcatDataset(parts)


def build_model(grid: int = 64, tasks: int = len(TASKS), width: int = 128) -> nn.Module:
    """A small MLP from the initial condition and task code to the solution at ``T``."""
    return nn.Sequential(
        nn.Linear(grid + tasks, width),
        nn.GELU(),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, grid),
    )
