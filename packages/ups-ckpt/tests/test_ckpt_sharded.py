"""The ``sharded`` backend: each rank's share written through DCP, loaded whole on any number of
ranks, the ``local`` backend's commit rule kept; and a training run resumed through it.

Multi-process tests run on real gloo process groups (``ups.core.testing.run_ranks``); their
rank functions are module-level so the spawned processes can import them.
"""

from __future__ import annotations

import collections
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from torch import nn

from ups.ckpt import CheckpointError, LocalCheckpointOptions, ShardedCheckpointer
from ups.ckpt._sharded import fingerprint, read_metadata, split, weighted_sum
from ups.ckpt.plugin import sharded_backend
from ups.core import Loaded, Manifest, RunContext, UnsafeCheckpointError, checksum, train
from ups.core.testing import assert_bitwise_equal, run_ranks, tiny_project

SINGLE = RunContext()


def checkpointer(directory: Path, ctx: RunContext = SINGLE) -> ShardedCheckpointer:
    return ShardedCheckpointer(ctx=ctx, directory=directory, options=LocalCheckpointOptions())


def training_state(rank: int) -> dict[str, Any]:
    """A model's and an Adam optimizer's state after one step (the same on every rank), plain
    values, and the rank's own generator state (not the same)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 6)).square().mean().backward()
    optimizer.step()
    torch.manual_seed(100 + rank)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": 7,
        "left": [3, (1, "a"), None],
        "rng": torch.get_rng_state(),
    }


def shard_sizes(checkpoint: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted((checkpoint / "shards").iterdir())}


# ---------------------------------------------------------------------------------------------
# Splitting and fingerprints


def test_split_names_tensors_by_path_and_leaves_meta_placeholders() -> None:
    state = {
        "model": collections.OrderedDict(w=torch.ones(2, 3)),
        "a/b": torch.zeros(1),
        "a": {"b": torch.arange(3)},
        "pair": (torch.tensor(2.0), "x"),
        "n": 4,
    }
    skeleton, tensors = split(state)
    assert list(tensors) == ["model/w", "a/b", "a/b#2", "pair/0"]
    assert skeleton["tensors"] == list(tensors)
    tree = skeleton["tree"]
    assert type(tree["model"]) is collections.OrderedDict
    assert tree["model"]["w"].is_meta and tree["model"]["w"].shape == (2, 3)
    assert tree["a"]["b"].dtype == torch.int64 and tree["pair"][1] == "x" and tree["n"] == 4
    assert tensors["a/b#2"] is state["a"]["b"]


TENSORS = [
    torch.randn(3, 5),
    torch.randn(4, 6).t(),  # not contiguous
    torch.arange(7, dtype=torch.uint8),  # bytes that do not divide in 32-bit words
    torch.arange(9, dtype=torch.uint8)[1:],  # words, not aligned
    torch.tensor([True, False, True, True]),
    torch.randn(3, dtype=torch.bfloat16),
    torch.tensor(1.5),
]


@pytest.mark.parametrize("tensor", TENSORS)
def test_a_fingerprint_tells_equal_tensors_from_others(tensor: torch.Tensor) -> None:
    assert fingerprint(tensor) == fingerprint(tensor.clone())
    assert fingerprint(tensor) != fingerprint(tensor.reshape(1, -1))
    if tensor.numel() > 1:
        assert fingerprint(tensor) != fingerprint(tensor.flip(0))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("tensor", TENSORS)
def test_the_checksum_off_the_cpu_tells_equal_tensors_from_others(tensor: torch.Tensor) -> None:
    # Computed here on the CPU, as it is on a GPU.
    assert weighted_sum(as_bytes(tensor)) == weighted_sum(as_bytes(tensor.clone()))
    if tensor.numel() > 1:
        assert weighted_sum(as_bytes(tensor)) != weighted_sum(as_bytes(tensor.flip(0)))


def test_the_checksum_off_the_cpu_is_not_fooled_by_constants_or_swaps() -> None:
    # A sum or an XOR of the elements would not tell these apart.
    zeros, sevens = torch.zeros(4, dtype=torch.int32), torch.full((4,), 7, dtype=torch.int32)
    assert weighted_sum(as_bytes(zeros)) != weighted_sum(as_bytes(sevens))
    a, b = torch.tensor([1, 2, 3, 4]), torch.tensor([2, 1, 3, 4])
    assert weighted_sum(as_bytes(a)) != weighted_sum(as_bytes(b))
    big = torch.randn(9 << 20)  # more than two chunks
    changed = big.clone()
    changed[-1] += 1
    assert weighted_sum(as_bytes(big)) != weighted_sum(as_bytes(changed))
    assert weighted_sum(as_bytes(torch.empty(0))) == 0


# ---------------------------------------------------------------------------------------------
# Two real ranks


def _two_ranks(ctx: RunContext, directory: str) -> dict[str, Any]:
    folder = Path(directory)
    state = training_state(ctx.rank)
    ckpt = checkpointer(folder / "sync", ctx)
    location = ckpt.save(
        state, step=7, rank_state={"rank": ctx.rank, "t": torch.ones(2) * ctx.rank}
    )
    loaded = ckpt.load_latest()

    options = LocalCheckpointOptions(async_save=True)
    in_background = sharded_backend(ctx=ctx, directory=folder / "async", options=options)
    in_background.save(state, step=8, rank_state={"rank": ctx.rank})
    in_background.wait()
    loaded_async = in_background.load_latest()

    broken = dict(state)  # rank 1's state holds a tensor that cannot be checksummed
    if ctx.rank == 1:
        broken["bad"] = torch.sparse_coo_tensor([[0]], [1.0], (2,))
    try:
        ckpt.save(broken, step=9, rank_state={})
    except CheckpointError as error:
        failure = str(error)
    else:
        raise AssertionError(f"rank {ctx.rank}: the failed save did not raise")
    after_failure = ckpt.load_latest()  # every rank is still in step with the others
    assert after_failure is not None
    return {
        "location": location,
        "loaded": loaded,
        "async": loaded_async,
        "failure": failure,
        "after_failure": after_failure.step,
    }


@pytest.mark.slow
def test_two_ranks_each_write_a_share_and_load_the_whole_state(tmp_path: Path) -> None:
    results = run_ranks(_two_ranks, 2, str(tmp_path))
    expected = training_state(0)
    step_7 = tmp_path / "sync" / "checkpoints" / "step-7"
    for rank, result in enumerate(results):
        assert result["location"] == str(step_7)
        for loaded, step in ((result["loaded"], 7), (result["async"], 8)):
            assert isinstance(loaded, Loaded) and loaded.step == step
            assert_bitwise_equal(loaded.state, expected)  # rank 0's generator state included
            assert loaded.rank_state is not None and loaded.rank_state["rank"] == rank
        assert torch.equal(result["loaded"].rank_state["t"], torch.ones(2) * rank)
        assert "saving checkpoint step 9 failed on rank" in result["failure"]
        assert "rank 1: " in result["failure"] and "sparse" in result["failure"].lower()
        assert result["after_failure"] == 7

    # Both ranks wrote tensors; the one that differs between ranks is rank 0's.
    sizes = shard_sizes(step_7)
    assert set(sizes) == {"metadata", "shard-0-0.distcp", "shard-1-0.distcp"}
    index = read_metadata(step_7 / "shards" / "metadata").storage_data
    files = {info.relative_path for info in index.values()}
    assert files == {"shard-0-0.distcp", "shard-1-0.distcp"}
    assert {i.relative_path for k, i in index.items() if k.fqn == "rng"} == {"shard-0-0.distcp"}
    manifest = Manifest.from_json((step_7 / "COMMIT").read_text())
    assert {f"shards/{name}" for name in sizes} <= set(manifest.files)
    assert not list((tmp_path / "sync" / "checkpoints").glob(".tmp-*"))  # step 9: nothing left

    # Loaded by one process: the whole state, no rank's own state.
    loaded = checkpointer(tmp_path / "sync").load_latest()
    assert loaded is not None and loaded.rank_state is None
    assert_bitwise_equal(loaded.state, expected)


# ---------------------------------------------------------------------------------------------
# One process: the commit rule


def test_one_process_writes_the_layout_and_loads_it_back(tmp_path: Path) -> None:
    state = training_state(0)
    location = Path(checkpointer(tmp_path).save(state, step=3, rank_state={"r": 0}))
    assert sorted(p.name for p in location.iterdir()) == [
        "COMMIT",
        "rank-0.pt",
        "shards",
        "skeleton.pt",
    ]
    assert set(shard_sizes(location)) == {"metadata", "shard-0-0.distcp"}
    manifest = Manifest.from_json((location / "COMMIT").read_text())
    assert set(manifest.files) == {
        "rank-0.pt",
        "skeleton.pt",
        "shards/metadata",
        "shards/shard-0-0.distcp",
    }
    loaded = checkpointer(tmp_path).load_latest()
    assert loaded is not None and loaded.rank_state == {"r": 0}
    assert_bitwise_equal(loaded.state, state)


def test_a_folder_without_commit_is_never_loaded(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path)
    ckpt.save({"w": torch.zeros(3)}, step=1, rank_state={})
    ckpt.save({"w": torch.ones(3)}, step=2, rank_state={})
    (tmp_path / "checkpoints" / "step-2" / "COMMIT").unlink()  # `latest` names it still
    with structlog.testing.capture_logs() as logs:
        loaded = ckpt.load_latest()
    assert loaded is not None and loaded.step == 1
    assert torch.equal(loaded.state["w"], torch.zeros(3))
    assert [e["event"] for e in logs] == ["'latest' names no committed checkpoint"]


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt = checkpointer(tmp_path)
    ckpt.save({"w": torch.zeros(1000)}, step=1, rank_state={})
    ckpt.save({"w": torch.ones(1000)}, step=2, rank_state={})
    shard = tmp_path / "checkpoints" / "step-2" / "shards" / "shard-0-0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    with structlog.testing.capture_logs() as logs:
        loaded = ckpt.load_latest()
    assert loaded is not None and loaded.step == 1
    assert torch.equal(loaded.state["w"], torch.zeros(1000))
    (warning,) = logs
    assert warning["event"] == "damaged checkpoint skipped: loading an older one"
    assert str(shard) in warning["damage"]


class RunsCode:
    """Unpickling this runs a shell command: what loading must never do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_an_index_that_would_run_code_is_refused(tmp_path: Path) -> None:
    location = Path(checkpointer(tmp_path).save({"w": torch.zeros(2)}, step=1, rank_state={}))
    marker = tmp_path / "pwned"
    index = location / "shards" / "metadata"
    index.write_bytes(pickle.dumps(RunsCode(marker)))
    commit = location / "COMMIT"
    manifest = Manifest.from_json(commit.read_text())  # a consistent, hostile checkpoint
    with open(index, "rb") as file:
        manifest.files["shards/metadata"] = checksum(file)
    commit.write_text(manifest.to_json())

    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load .*metadata: posix\.system"):
        checkpointer(tmp_path).load_latest()
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# Through the engine

DROPOUT_NET = '''"""A net whose training draws from the generators (dropout)."""
import torch
from torch import nn


def build(hidden=12):
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Dropout(p=0.25), nn.Linear(hidden, 1))
'''


def _train(folder: Path, max_steps: int) -> Any:
    """2 ranks, 64 samples in batches of 4 (8 steps an epoch), a checkpoint every 3 steps
    written in the background, resumed from the latest."""
    config = tiny_project(
        folder,
        model={"factory": "dropout_net.py:build"},
        training={"epochs": 2, "batch_size": 4, "max_steps": max_steps},
        sampler={"name": "torch"},
        checkpoint={
            "name": "sharded",
            "every_steps": 3,
            "resume": "latest",
            "options": {"keep_last": 2, "async_save": True},
        },
    )
    (folder / "dropout_net.py").write_text(DROPOUT_NET)
    return train(config, nproc=2)


@pytest.mark.slow
def test_a_run_resumed_from_a_sharded_checkpoint_ends_bitwise_equal(tmp_path: Path) -> None:
    whole = _train(tmp_path / "whole", 12)
    assert _train(tmp_path / "parts", 5).steps == 5  # stopped mid-epoch
    rest = _train(tmp_path / "parts", 12)
    assert (rest.steps, rest.epochs) == (whole.steps, whole.epochs) == (12, 2)
    finals = []
    for result in (whole, rest):
        loaded = checkpointer(Path(result.checkpoint).parents[1]).load_latest()
        assert loaded is not None and loaded.step == 12
        finals.append(loaded.state)
    for key in ("model", "optimizer", "step", "epoch", "epoch_left", "rng", "sampler"):
        assert_bitwise_equal(finals[0][key], finals[1][key])
    # The reports after the first one of the resumed run (its window began at the stop).
    assert rest.losses[1:] == whole.losses[len(whole.losses) - len(rest.losses) + 1 :]
