"""What tests assert about training: the checkpoint a run saved, parameters and states equal
(closely or bitwise), the all-reduces a step made, and the metrics a tracker was handed."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint._commit import STATE_FILE, rank_file

if TYPE_CHECKING:
    pass


def tracker_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The run folder's ``metrics.jsonl`` as an experiment tracker should hold it: each metric
    as ``KIND/NAME`` (``train/loss``, ``eval/loss/TASK``) with its ``(step, value)`` pairs by
    step; at a step reported twice (a resumed run) the later line wins; ``null`` left out, and
    the ``phases`` lines (each rank's step times, for ``ups report``: not a tracker's)."""
    found: dict[str, dict[int, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        kind, step = record.pop("kind"), record.pop("step")
        if kind == "phases":
            continue
        for name, value in record.items():
            if value is not None:
                found.setdefault(f"{kind}/{name}", {})[step] = value
    return {key: sorted(steps.items()) for key, steps in found.items()}


@contextlib.contextmanager
def counting_all_reduces() -> Iterator[list[int]]:
    """While open, count this process's calls of ``torch.distributed.all_reduce`` (each still
    runs); yields a one-item list holding the count so far."""
    import torch.distributed as dist

    count = [0]
    all_reduce = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield count
    finally:
        dist.all_reduce = all_reduce


def read_checkpoint(location: str | os.PathLike[str]) -> dict[str, Any]:
    """A committed checkpoint folder's files, read as they are (``weights_only``, not verified):
    ``{"state": <state.pt>, "ranks": [<rank-0.pt>, <rank-1.pt>, ...]}``."""
    folder = Path(location)
    ranks: list[Any] = []
    while (path := folder / rank_file(len(ranks))).is_file():
        ranks.append(torch.load(path, weights_only=True))
    return {"state": torch.load(folder / STATE_FILE, weights_only=True), "ranks": ranks}


def assert_params_close(
    found: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], atol: float = 1e-6
) -> None:
    """Assert that two models' parameters (name to tensor, as a checkpoint's ``model``) have
    the same names and differ by at most ``atol`` each, absolutely: the equivalence the
    engine promises (N ranks as one process, k micro-batches as one batch) in fp32. The
    message names the first parameter that differs."""
    assert found.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(found[name], expected[name], rtol=0, atol=atol, msg=name)


def assert_bitwise_equal(found: Any, expected: Any, where: str = "state") -> None:
    """Assert that two states are equal to the bit: the same container types and keys, and
    tensors of the same dtype, shape and bytes (so NaN equals NaN, and -0.0 differs from 0.0).
    The message names the path of the first difference (``state['model']['0.weight']``)."""
    assert type(found) is type(expected), f"{where}: {type(found)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert (found.dtype, found.shape) == (expected.dtype, expected.shape), where
        as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (found, expected)]
        assert torch.equal(*as_bytes), f"{where}: the bytes differ"
    elif isinstance(expected, dict):
        assert list(found) == list(expected), f"{where}: keys {list(found)} != {list(expected)}"
        for key in expected:
            assert_bitwise_equal(found[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert len(found) == len(expected), f"{where}: length {len(found)} != {len(expected)}"
        for i, (x, y) in enumerate(zip(found, expected, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert found == expected, f"{where}: {found!r} != {expected!r}"
