"""Generate the data of the neural-operator example: three 2-D PDEs, one HDF5 file per task.

All three tasks are members of one family of scalar equations on the periodic square
``[0, 2 pi)^2``, named by four coefficients ``(nu, cx, cy, beta)``::

    u_t + cx u_x + cy u_y + beta u (u_x + u_y) = nu (u_xx + u_yy)

- ``diffusion``: ``(nu, 0, 0, 0)``, solved exactly (mode ``k`` decays as ``exp(-nu |k|^2 t)``);
- ``advection``: ``(0, cx, cy, 0)``, solved exactly (a shift: a phase in Fourier space);
- ``burgers``: ``(nu, 0, 0, 1)``, viscous Burgers, integrated pseudo-spectrally (Heun's method,
  the viscous term exact through an integrating factor, the product de-aliased by the 2/3 rule).

Initial conditions are random sums of a few Fourier modes, from a generator seeded by
``(seed, task)``: a file depends only on its task, its number of samples and the seed, which
its name carries, so train and evaluation sets (other seeds) share a folder. The layout is
PDEBench's: ``tensor`` ``[N, T, X, Y]`` (float32), ``x-coordinate`` ``[X]``, ``y-coordinate``
``[Y]``, ``t-coordinate`` ``[T]``, and ``params`` ``[N, 4]`` (its ``names`` attribute lists
the coefficients).

    python examples/pde_operator/generate.py data/pde_operator --samples 512
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np

TASKS = ("diffusion", "advection", "burgers")
PARAM_NAMES = ("nu", "cx", "cy", "beta")
GRID = 32
TIMES = (0.0, 0.25, 0.5, 0.75, 1.0)
MODES = 4  # Fourier modes summed in an initial condition
BURGERS_DT = 0.025


def file_name(task: str, samples: int, seed: int) -> str:
    """The file of ``task``'s ``samples`` samples drawn from ``seed``."""
    return f"2D_{task}_N{samples}_seed{seed}.h5"


def _wavenumbers(grid: int) -> tuple[np.ndarray, np.ndarray]:
    """Integer wavenumbers ``(kx [X, 1], ky [1, Y//2+1])`` of ``rfft2`` on ``[0, 2 pi)^2``."""
    return np.fft.fftfreq(grid, 1 / grid)[:, None], np.fft.rfftfreq(grid, 1 / grid)[None, :]


def _initial_conditions(n: int, grid: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` fields ``sum_m a_m sin(kx_m x + ky_m y + phi_m)``, ``|k| <= 3``, ``[n, X, Y]``."""
    x = np.arange(grid) * (2 * np.pi / grid)
    k = rng.integers(-3, 4, size=(n, MODES, 2))
    k[(k == 0).all(axis=2)] = (1, 0)  # no constant mode
    amplitude = rng.uniform(-1, 1, size=(n, MODES)) / np.linalg.norm(k, axis=2)
    phase = rng.uniform(0, 2 * np.pi, size=(n, MODES))
    angle = (
        k[:, :, 0, None, None] * x[None, None, :, None]
        + k[:, :, 1, None, None] * x[None, None, None, :]
        + phase[:, :, None, None]
    )
    return (amplitude[:, :, None, None] * np.sin(angle)).sum(axis=1)


def _diffusion(u0: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n, grid = u0.shape[0], u0.shape[1]
    nu = 10 ** rng.uniform(-2, -1, size=n)
    kx, ky = _wavenumbers(grid)
    u0_hat = np.fft.rfft2(u0)
    frames = [
        np.fft.irfft2(u0_hat * np.exp(-nu[:, None, None] * (kx**2 + ky**2) * t), s=(grid, grid))
        for t in TIMES
    ]
    params = np.zeros((n, len(PARAM_NAMES)))
    params[:, 0] = nu
    return np.stack(frames, axis=1), params


def _advection(u0: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n, grid = u0.shape[0], u0.shape[1]
    c = rng.uniform(-1, 1, size=(n, 2))
    kx, ky = _wavenumbers(grid)
    u0_hat = np.fft.rfft2(u0)
    phase = c[:, 0, None, None] * kx + c[:, 1, None, None] * ky
    frames = [np.fft.irfft2(u0_hat * np.exp(-1j * phase * t), s=(grid, grid)) for t in TIMES]
    params = np.zeros((n, len(PARAM_NAMES)))
    params[:, 1:3] = c
    return np.stack(frames, axis=1), params


def _burgers(u0: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n, grid = u0.shape[0], u0.shape[1]
    nu = rng.uniform(0.05, 0.2, size=n)
    kx, ky = _wavenumbers(grid)
    dealias = (np.abs(kx) < grid / 3) & (np.abs(ky) < grid / 3)
    decay = np.exp(-nu[:, None, None] * (kx**2 + ky**2) * BURGERS_DT)  # one step's factor

    def rate(v_hat: np.ndarray) -> np.ndarray:  # -(d/dx + d/dy)(u^2 / 2), in Fourier space
        v = np.fft.irfft2(v_hat * dealias, s=(grid, grid))
        return -0.5j * (kx + ky) * np.fft.rfft2(v * v) * dealias

    u_hat, frames, t = np.fft.rfft2(u0), [u0], 0.0
    for target in TIMES[1:]:
        while t < target - 1e-9:  # Heun's method on the integrating-factor form
            k1 = rate(u_hat)
            guess = decay * (u_hat + BURGERS_DT * k1)
            u_hat = decay * (u_hat + 0.5 * BURGERS_DT * k1) + 0.5 * BURGERS_DT * rate(guess)
            t += BURGERS_DT
        frames.append(np.fft.irfft2(u_hat, s=(grid, grid)))
    params = np.zeros((n, len(PARAM_NAMES)))
    params[:, 0], params[:, 3] = nu, 1.0
    return np.stack(frames, axis=1), params


_SOLVERS = {"diffusion": _diffusion, "advection": _advection, "burgers": _burgers}


def generate(task: str, samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tensor [N, T, X, Y], params [N, 4])`` of ``task``, float32, the same for a seed."""
    if task not in _SOLVERS:
        raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
    rng = np.random.default_rng([seed, TASKS.index(task)])
    tensor, params = _SOLVERS[task](_initial_conditions(samples, GRID, rng), rng)
    return tensor.astype(np.float32), params.astype(np.float32)


def write(path: Path, task: str, samples: int, seed: int) -> None:
    """Write ``task``'s file to ``path`` atomically: a unique temporary name in the same
    folder, then ``os.replace``, so a reader never sees a partial file and concurrent
    writers (several ranks) each replace it with the same content."""
    tensor, params = generate(task, samples, seed)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with h5py.File(temporary, "w") as f:
            f.create_dataset("tensor", data=tensor)
            f.create_dataset("params", data=params).attrs["names"] = list(PARAM_NAMES)
            coordinate = (np.arange(GRID) * (2 * np.pi / GRID)).astype(np.float32)
            f.create_dataset("x-coordinate", data=coordinate)
            f.create_dataset("y-coordinate", data=coordinate)
            f.create_dataset("t-coordinate", data=np.asarray(TIMES, dtype=np.float32))
            f.attrs.update({"task": task, "seed": seed, "samples": samples})
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def ensure_data(
    root: str | os.PathLike[str],
    samples_per_task: int,
    seed: int,
    tasks: Sequence[str] = TASKS,
) -> list[Path]:
    """The files of ``tasks`` in ``root``, generating those missing; safe to call from
    several processes at once. Returns their paths, in the order of ``tasks``."""
    folder = Path(root)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for task in tasks:
        path = folder / file_name(task, samples_per_task, seed)
        if not path.is_file():
            write(path, task, samples_per_task, seed)
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    """``python generate.py OUT_DIR [--samples N] [--seed S] [--tasks a,b]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--samples", type=int, default=256, help="samples per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated")
    args = parser.parse_args(argv)
    for path in ensure_data(args.out_dir, args.samples, args.seed, args.tasks.split(",")):
        print(path)


if __name__ == "__main__":
    main()
