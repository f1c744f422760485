"""The ``fsspec`` backend against a real S3 API (a moto server on 127.0.0.1, through s3fs),
and on a local path.

Multi-process tests run on real gloo process groups (``ups.core.testing.run_ranks``); their
rank functions are module-level so the spawned processes can import them. The spawned ranks
inherit the session's environment, which holds the moto server's dummy credentials.
"""

from __future__ import annotations

import io
import json
import os
import re
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec  # type: ignore[import-untyped]
import pytest
import structlog
import torch

from ups.ckpt import (
    CheckpointError,
    FsspecCheckpointer,
    FsspecCheckpointOptions,
    UnsafeCheckpointError,
)
from ups.ckpt.plugin import fsspec_backend
from ups.core import ConfigError, RunContext, load_plugins, train
from ups.core.testing import assert_bitwise_equal, run_ranks, tiny_project

if TYPE_CHECKING:
    from s3 import S3Prefix

pytest_plugins = ["s3"]  # the moto server and the `s3` fixture

SINGLE = RunContext()


def checkpointer(
    url: str,
    storage_options: dict[str, Any],
    ctx: RunContext = SINGLE,
    directory: Path = Path("unused"),
    **options: Any,
) -> FsspecCheckpointer:
    return FsspecCheckpointer(
        ctx=ctx,
        directory=directory,
        options=FsspecCheckpointOptions(url=url, storage_options=storage_options, **options),
    )


def prefixes(s3: S3Prefix) -> list[str]:
    """The top level under the URL: ``latest`` and the ``step-<N>`` prefixes."""
    return sorted({key.split("/")[0] for key in s3.objects()})


class RunsCode:
    """Unpickling this runs a shell command: exactly what must never happen on load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


# ---------------------------------------------------------------------------------------------
# Two real ranks


def _round_trip(ctx: RunContext, url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    ckpt = checkpointer(url, storage_options, ctx)
    empty = ckpt.load_latest()
    weights = torch.arange(6.0).reshape(2, 3) * (ctx.rank + 1)  # only rank 0's is kept
    mine = {"rank": ctx.rank, "t": torch.full((2,), float(ctx.rank))}
    ckpt.save({"w": weights}, step=5, rank_state=mine)
    location = ckpt.save({"w": weights + 1}, step=10, rank_state=mine)
    unsafe = {"rng": RunsCode(Path("/nonexistent/pwned"))} if ctx.rank == 1 else {}
    try:
        ckpt.save({"w": weights}, step=15, rank_state=unsafe)
    except UnsafeCheckpointError as error:
        refused = str(error)
    else:
        raise AssertionError(f"rank {ctx.rank}: the unsafe save did not raise")
    loaded = ckpt.load_latest()  # every rank is still in step with the others
    assert loaded is not None
    return {
        "empty": empty,
        "location": location,
        "refused": refused,
        "loaded": loaded,
        "background": _in_background(ctx, f"{url}/background", storage_options),
    }


def _in_background(ctx: RunContext, url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """Saves with ``async_save`` (in the same processes: spawning ranks is what takes time)."""
    options = FsspecCheckpointOptions(url=url, storage_options=storage_options, async_save=True)
    ckpt = fsspec_backend(ctx=ctx, directory=Path("unused"), options=options)
    state = {"w": torch.ones(3)}
    location = ckpt.save(state, step=3, rank_state={"rank": ctx.rank})
    state["w"].add_(1)  # training goes on: the checkpoint holds the state as it was
    ckpt.wait()
    committed = [c.step for c in checkpointer(url, storage_options, ctx).committed()]
    ckpt.save(state, step=6, rank_state={"rank": ctx.rank})
    loaded = ckpt.load_latest()  # waits for the save in flight
    return {"location": location, "committed": committed, "loaded": loaded}


@pytest.mark.slow
def test_two_ranks_save_and_load_each_their_own_state_in_the_foreground_or_background(
    s3: S3Prefix,
) -> None:
    results = run_ranks(_round_trip, 2, s3.url, s3.storage_options)
    expected = torch.arange(6.0).reshape(2, 3) + 1  # rank 0's state
    for rank, result in enumerate(results):
        assert result["empty"] is None
        assert result["location"] == f"{s3.url}/step-10"
        assert result["refused"].startswith(
            f"saving checkpoint step 15 under {s3.url} failed on rank 1: "
            "UnsafeCheckpointError: the state holds objects that loading with weights_only=True "
            "refuses"
        )
        loaded = result["loaded"]
        assert (loaded.step, loaded.location) == (10, f"{s3.url}/step-10")
        assert torch.equal(loaded.state["w"], expected)
        assert loaded.rank_state["rank"] == rank
        assert torch.equal(loaded.rank_state["t"], torch.full((2,), float(rank)))

        background = result["background"]
        assert background["location"] == f"{s3.url}/background/step-3"
        assert background["committed"] == [3]  # by wait()
        loaded = background["loaded"]
        assert loaded.step == 6 and loaded.rank_state == {"rank": rank}
        assert torch.equal(loaded.state["w"], torch.full((3,), 2.0))
    first = torch.load(io.BytesIO(s3.get("background/step-3/state.pt")), weights_only=True)
    assert torch.equal(first["w"], torch.ones(3))

    assert s3.get("latest") == b"step-10\n"
    files = ["COMMIT", "rank-0.pt", "rank-1.pt", "state.pt"]
    assert [key for key in s3.objects() if not key.startswith("background/")] == [
        "latest",
        *(f"step-10/{f}" for f in files),
        *(f"step-5/{f}" for f in files),
    ]
    commit = json.loads(s3.get("step-10/COMMIT"))
    assert (commit["step"], commit["world_size"]) == (10, 2)
    for name, record in commit["files"].items():
        data = s3.get(f"step-10/{name}")
        assert record == {"size": len(data), "crc32": zlib.crc32(data)}

    # Loaded by one rank: the same state, and no rank state (it was saved by 2).
    loaded = checkpointer(s3.url, s3.storage_options).load_latest()
    assert loaded is not None
    assert loaded.step == 10 and loaded.rank_state is None
    assert torch.equal(loaded.state["w"], expected)


# ---------------------------------------------------------------------------------------------
# One process


def test_an_uncommitted_prefix_is_never_loaded_and_the_next_run_deletes_it(
    s3: S3Prefix,
) -> None:
    ckpt = checkpointer(s3.url, s3.storage_options)
    ckpt.save({"w": torch.zeros(2)}, step=1, rank_state={})
    # A save that crashed before its COMMIT, which `latest` even names ...
    buffer = io.BytesIO()
    torch.save({"w": torch.full((2,), 8.0)}, buffer)
    s3.put("step-8/state.pt", buffer.getvalue())
    s3.put("latest", b"step-8\n")
    # ... and one whose COMMIT is torn: not loaded, and not deleted (it may be newer software's).
    s3.put("step-9/state.pt", buffer.getvalue())
    s3.put("step-9/COMMIT", s3.get("step-1/COMMIT")[:40])

    with structlog.testing.capture_logs() as logs:
        loaded = ckpt.load_latest()
    assert loaded is not None
    assert loaded.step == 1 and torch.equal(loaded.state["w"], torch.zeros(2))
    events = {log["event"]: log for log in logs}
    assert events["'latest' names no committed checkpoint"]["latest"] == f"{s3.url}/step-8"
    assert events["unreadable COMMIT; checkpoint ignored"]["checkpoint"] == f"{s3.url}/step-9"

    checkpointer(s3.url, s3.storage_options).save({"w": torch.ones(2)}, step=2, rank_state={})
    assert prefixes(s3) == ["latest", "step-1", "step-2", "step-9"]


def test_a_damaged_object_falls_back_to_the_previous_checkpoint(s3: S3Prefix) -> None:
    ckpt = checkpointer(s3.url, s3.storage_options)
    ckpt.save({"w": torch.zeros(100)}, step=1, rank_state={})
    ckpt.save({"w": torch.ones(100)}, step=2, rank_state={})
    saved = s3.get("step-2/state.pt")
    s3.put("step-2/state.pt", saved[: len(saved) // 2])

    with structlog.testing.capture_logs() as logs:
        loaded = ckpt.load_latest()
    assert loaded is not None
    assert loaded.step == 1 and torch.equal(loaded.state["w"], torch.zeros(100))
    [warning] = logs
    assert warning["event"] == "damaged checkpoint skipped: loading an older one"
    assert warning["checkpoint"] == f"{s3.url}/step-2"
    assert warning["damage"].startswith(f"{s3.url}/step-2/state.pt has {len(saved) // 2} bytes")
    assert f"COMMIT says {len(saved)} bytes" in warning["damage"]

    s3.client.delete_object(Bucket="ups-checkpoints", Key=f"{s3.prefix}/step-1/rank-0.pt")
    with (
        structlog.testing.capture_logs() as logs,
        pytest.raises(CheckpointError, match=rf"no checkpoint under {re.escape(s3.url)} verifies"),
    ):
        ckpt.load_latest()
    assert logs[-1]["damage"] == f"{s3.url}/step-1/rank-0.pt is missing"


def test_retention_keeps_the_newest_the_multiples_and_what_latest_names(s3: S3Prefix) -> None:
    ckpt = checkpointer(s3.url, s3.storage_options, keep_last=2, keep_every=3)
    for step in range(1, 8):
        ckpt.save({"step": step}, step=step, rank_state={})
    assert prefixes(s3) == ["latest", "step-3", "step-6", "step-7"]
    # Resumed from step 3 and saved step 3 again: `latest` names it; keep_last=1 keeps the
    # newest (step-7) and never deletes the checkpoint `latest` names.
    ckpt = checkpointer(s3.url, s3.storage_options, keep_last=1)
    assert ckpt.save({"step": 3, "again": True}, step=3, rank_state={}) == f"{s3.url}/step-3"
    assert prefixes(s3) == ["latest", "step-3", "step-7"]
    loaded = ckpt.load_latest()
    assert loaded is not None
    assert loaded.step == 3 and loaded.state["again"] is True
    ckpt.save({"step": 8}, step=8, rank_state={})
    assert prefixes(s3) == ["latest", "step-8"]


def test_a_state_that_would_run_code_is_refused_on_save(s3: S3Prefix, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(UnsafeCheckpointError, match="weights_only=True refuses"):
        checkpointer(s3.url, s3.storage_options).save(
            {"w": RunsCode(marker)}, step=1, rank_state={}
        )
    assert not marker.exists()
    assert s3.objects() == []


def test_a_planted_pickle_that_would_run_code_is_refused_on_load(
    s3: S3Prefix, tmp_path: Path
) -> None:
    ckpt = checkpointer(s3.url, s3.storage_options)
    ckpt.save({"w": torch.zeros(1)}, step=1, rank_state={})
    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"w": RunsCode(marker)}, buffer)
    hostile = buffer.getvalue()
    s3.put("step-1/state.pt", hostile)
    manifest = json.loads(s3.get("step-1/COMMIT"))  # a consistent, hostile checkpoint
    manifest["files"]["state.pt"] = {"size": len(hostile), "crc32": zlib.crc32(hostile)}
    s3.put("step-1/COMMIT", json.dumps(manifest).encode())

    with pytest.raises(UnsafeCheckpointError) as caught:
        ckpt.load_latest()
    assert f"refusing to load {s3.url}/step-1/state.pt" in str(caught.value)
    assert "system" in str(caught.value)  # names what it refused
    assert not marker.exists()


@pytest.mark.parametrize("scheme", ["relative", "file"])
def test_a_local_path_works_too(tmp_path: Path, scheme: str) -> None:
    folder = tmp_path / "run" / "ckpts"
    url = "ckpts" if scheme == "relative" else f"file://{folder}"
    ckpt = checkpointer(url, {}, directory=tmp_path / "run", keep_last=1)
    ckpt.save({"w": torch.zeros(2)}, step=1, rank_state={"r": 0})
    location = ckpt.save({"w": torch.ones(2)}, step=2, rank_state={"r": 0})
    assert location == (str(folder) if scheme == "relative" else url) + "/step-2"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-2"]
    assert sorted(p.name for p in (folder / "step-2").iterdir()) == [
        "COMMIT",
        "rank-0.pt",
        "state.pt",
    ]
    loaded = ckpt.load_latest()
    assert loaded is not None
    assert loaded.step == 2 and loaded.rank_state == {"r": 0}
    assert torch.equal(loaded.state["w"], torch.ones(2))


def test_the_backend_is_registered_and_its_options_never_show_their_values() -> None:
    registry = load_plugins(env={})
    provided = registry.records("checkpoint")["fsspec"]
    assert provided.plugin == "ups-ckpt"
    assert provided.record.factory is fsspec_backend
    given = {"url": "s3://bucket/run", "storage_options": {"secret": "hunter2"}}
    _, options = registry.select("checkpoint", "fsspec", given, "checkpoint")
    assert options == FsspecCheckpointOptions(
        url="s3://bucket/run", storage_options={"secret": "hunter2"}
    )
    assert "hunter2" not in repr(options)
    assert "<storage options: secret>" in repr(options)
    with pytest.raises(ConfigError, match=r"checkpoint\.options\.url: is required"):
        registry.select("checkpoint", "fsspec", {}, "checkpoint")
    with pytest.raises(ConfigError, match=r"checkpoint\.options: nosuch://x: ValueError"):
        checkpointer("nosuch://x", {})


# ---------------------------------------------------------------------------------------------
# End to end: the engine stopped and resumed from S3


def project(folder: Path, s3: S3Prefix, max_steps: int) -> Path:
    """The tiny project on 2 ranks (batches of 4: 8 steps an epoch), checkpointing every 3
    steps to ``s3`` (under a prefix of the folder's name), resuming from the latest."""
    return tiny_project(
        folder,
        training={"epochs": 2, "batch_size": 4, "max_steps": max_steps},
        sampler={"name": "torch"},
        checkpoint={
            "name": "fsspec",
            "every_steps": 3,
            "resume": "latest",
            "options": {"url": f"{s3.url}/{folder.name}", "storage_options": s3.storage_options},
        },
    )


def final_state(location: str | None, s3: S3Prefix) -> dict[str, Any]:
    assert location is not None and location.startswith(s3.url)
    with fsspec.open(f"{location}/state.pt", "rb", **s3.storage_options) as file:
        state: dict[str, Any] = torch.load(file, weights_only=True)
    return state


@pytest.mark.slow
def test_a_run_stopped_and_resumed_from_s3_ends_bitwise_equal(tmp_path: Path, s3: S3Prefix) -> None:
    whole = train(project(tmp_path / "whole", s3, 10), nproc=2)
    assert train(project(tmp_path / "parts", s3, 5), nproc=2).steps == 5
    rest = train(project(tmp_path / "parts", s3, 10), nproc=2)
    assert (rest.steps, rest.epochs) == (whole.steps, whole.epochs)
    a, b = final_state(whole.checkpoint, s3), final_state(rest.checkpoint, s3)
    assert b["step"] == 10
    for key in ("model", "optimizer", "step", "epoch", "epoch_left", "rng"):
        assert_bitwise_equal(a[key], b[key])
    # The reports after the first one (whose window began at the stop) are the same too.
    assert rest.losses[1:] == whole.losses[-len(rest.losses) + 1 :]
