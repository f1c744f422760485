"""Draw docs/samplers_mix.png: one epoch of the ``multitask`` sampler next to torch's
``DistributedSampler``, over the same four tasks, on four ranks.

    python docs/samplers_mix.py

Each row of a grid is a rank's samples in the order the rank reads them, each cell coloured by
its task; the bars beside it count each rank's samples of each task. Needs matplotlib.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import torch
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.patches import Rectangle
from torch.utils.data import ConcatDataset, DistributedSampler, Sampler, TensorDataset

from ups.samplers import MultiTaskDistributedSampler

SIZES = (400, 200, 100, 50)
WORLD = 4
SEED = 0
COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759")
OUTPUT = Path(__file__).with_suffix(".png")


def task_rows(
    samplers: Sequence[Sampler[int]], dataset: ConcatDataset[tuple[torch.Tensor, ...]]
) -> torch.Tensor:
    """The task of every sample each rank reads, one row a rank (``-1`` past a short row)."""
    ends = torch.tensor(dataset.cumulative_sizes)
    rows = [torch.searchsorted(ends, torch.tensor(list(s)), right=True) for s in samplers]
    grid = torch.full((len(rows), max(len(row) for row in rows)), -1)
    for r, row in enumerate(rows):
        grid[r, : len(row)] = row
    return grid


def draw(cells: Axes, bars: Axes, grid: torch.Tensor, title: str) -> None:
    shown = torch.where(grid < 0, len(SIZES), grid)  # empty cells in white
    cells.imshow(
        shown.numpy(),
        cmap=ListedColormap([*COLOURS, "white"]),
        vmin=0,
        vmax=len(SIZES),
        aspect="auto",
        interpolation="nearest",
    )
    for edge in range(1, WORLD):
        cells.axhline(edge - 0.5, color="white", linewidth=2)
    cells.set_title(title, fontsize=10, loc="left")
    cells.set_yticks(range(WORLD), [f"rank {r}" for r in range(WORLD)])
    cells.set_xlabel("position in the rank's epoch")
    width = 0.8 / len(SIZES)
    for t, colour in enumerate(COLOURS):
        counts = (grid == t).sum(dim=1)
        x = torch.arange(WORLD) + (t - (len(SIZES) - 1) / 2) * width
        bars.bar(x.numpy(), counts.numpy(), width, color=colour)
        for xi, count in zip(x.tolist(), counts.tolist(), strict=True):
            bars.text(xi, count, str(count), ha="center", va="bottom", fontsize=6)
    bars.set_xticks(range(WORLD), [f"rank {r}" for r in range(WORLD)])
    bars.set_ylabel("samples")
    bars.set_title("samples of each task", fontsize=10)


def main() -> None:
    # Only the layout matters: task t is indices offset[t] .. offset[t] + SIZES[t] - 1.
    dataset: ConcatDataset[tuple[torch.Tensor, ...]] = ConcatDataset(
        [TensorDataset(torch.zeros(size)) for size in SIZES]
    )
    multitask = [
        MultiTaskDistributedSampler(
            dataset, WORLD, rank, mixing="temperature", temperature=2.0, seed=SEED, batch_size=8
        )
        for rank in range(WORLD)
    ]
    flat: list[DistributedSampler[int]] = [
        DistributedSampler(dataset, WORLD, rank, seed=SEED) for rank in range(WORLD)
    ]
    for sampler in multitask:
        sampler.set_epoch(0)
    for torch_sampler in flat:
        torch_sampler.set_epoch(0)
    figure, axes = plt.subplots(
        2, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": (3, 1)}, layout="constrained"
    )
    axes[0, 1].sharey(axes[1, 1])
    draw(
        axes[0, 0],
        axes[0, 1],
        task_rows(multitask, dataset),
        "multitask (temperature 2.0, batch 8): every global batch dealt evenly to the ranks",
    )
    draw(
        axes[1, 0],
        axes[1, 1],
        task_rows(flat, dataset),
        "torch DistributedSampler (shuffle): one flat list, each rank's mix left to chance",
    )
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in COLOURS]
    labels = [f"task {t} ({size} samples)" for t, size in enumerate(SIZES)]
    figure.legend(handles, labels, loc="outside lower center", ncols=len(SIZES), fontsize=9)
    figure.savefig(OUTPUT, dpi=90)
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
