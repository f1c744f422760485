"""``async_save``: staged copies, written in the background on a process group of its own.

The two-rank tests hold rank 0's background writer at its first file (a stand-in for a slow
disk, installed as the wrapped checkpointer's ``storage.write_file``) to observe
what happens while a save is in flight.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ups.ckpt import (
    CheckpointError,
    InBackground,
    LocalCheckpointer,
    LocalCheckpointOptions,
    Stager,
    stage,
)
from ups.ckpt.plugin import local_backend
from ups.core import Checkpointer, FileRecord, FolderStorage, RunContext
from ups.core.testing import run_ranks

WAIT_S = 30.0
ASYNC = LocalCheckpointOptions(keep_last=None, async_save=True)


class Opaque:
    """Loading with ``weights_only=True`` refuses it."""


def storage(ckpt: Checkpointer) -> FolderStorage:
    """The folder storage of a background checkpointer's wrapped ``local`` checkpointer."""
    assert isinstance(ckpt, InBackground) and isinstance(ckpt.inner, LocalCheckpointer)
    return ckpt.inner.storage


class Holder:
    """Holds rank 0's writer thread before it writes ``state.pt``, until released."""

    def __init__(self, ctx: RunContext, ckpt: Checkpointer) -> None:
        self.ctx = ctx
        self.entered, self.gate = threading.Event(), threading.Event()
        self.storage = storage(ckpt)
        self.real_write = self.storage.write_file

    def __enter__(self) -> Holder:
        self.storage.write_file = self._write
        return self

    def __exit__(self, *exc: object) -> None:
        self.gate.set()
        self.storage.write_file = self.real_write

    def _write(self, path: Path, obj: Mapping[str, Any]) -> FileRecord:
        if self.ctx.is_main and path.name == "state.pt":
            self.entered.set()
            assert self.gate.wait(WAIT_S), "never released"
        return self.real_write(path, obj)

    def hold(self) -> None:
        """Hold the next save's writer (on rank 0) when it reaches ``state.pt``."""
        self.gate.clear()
        self.entered.clear()

    def until_held(self) -> None:
        """On rank 0, wait until its writer is held."""
        if self.ctx.is_main:
            assert self.entered.wait(WAIT_S), "the background save never began writing"


def _in_flight(ctx: RunContext, directory: str) -> dict[str, Any]:
    folder = Path(directory) / "checkpoints"
    ckpt = local_backend(ctx=ctx, directory=Path(directory), options=ASYNC)
    assert isinstance(ckpt, InBackground)
    found: dict[str, Any] = {}
    with Holder(ctx, ckpt) as holder:
        # Training's tensors: the replicated ones the same on every rank, a rank's its own.
        w, layers = torch.arange(6.0), [torch.ones(2), torch.zeros(2)]
        model = {"w": w, "layers": layers}
        param = torch.nn.Parameter(torch.full((3,), 2.0))
        gen = torch.tensor([ctx.rank, 7])
        mine = {"gen": gen, "rank": ctx.rank}
        holder.hold()
        found["location"] = ckpt.save(
            {"model": model, "p": param, "step": 1}, step=1, rank_state=mine
        )
        holder.until_held()
        found["committed_at_return"] = (folder / "step-1").exists()
        # Training goes on at once and changes its tensors in place.
        w.add_(100)
        layers[0].mul_(-1)
        with torch.no_grad():
            param.add_(5)
        gen.add_(50)
        # ... and runs collectives on the default group while the save is in flight: rank 1's
        # writer is in the save's own collectives meanwhile.
        sums = []
        for i in range(20):
            value = torch.tensor([float(ctx.rank + i)])
            dist.all_reduce(value)
            sums.append(value.item())
        found["sums"] = sums
        found["committed_while_held"] = (folder / "step-1").exists()
        holder.gate.set()
        ckpt.wait()
        found["committed_after_wait"] = (folder / "step-1" / "COMMIT").is_file()
        found["loaded"] = ckpt.load_latest()

        # One save in flight at a time: the next save waits for the one before to commit.
        holder.hold()
        ckpt.save({"step": 2}, step=2, rank_state={})
        holder.until_held()
        if ctx.is_main:
            threading.Timer(0.5, holder.gate.set).start()
        ckpt.save({"step": 3}, step=3, rank_state={})
        found["step_2_committed_when_3_returned"] = (folder / "step-2" / "COMMIT").is_file()
        ckpt.wait()
        found["latest"] = (folder / "latest").read_text()
    return found


@pytest.mark.slow
def test_a_save_returns_at_once_with_copies_and_commits_on_its_own_group(tmp_path: Path) -> None:
    results = run_ranks(_in_flight, 2, str(tmp_path), timeout_s=WAIT_S)
    folder = tmp_path / "checkpoints"
    for rank, found in enumerate(results):
        assert found["location"] == str(folder / "step-1")
        assert not found["committed_at_return"], f"rank {rank}: save waited for the commit"
        assert not found["committed_while_held"]
        assert found["sums"] == [float(1 + 2 * i) for i in range(20)]
        assert found["committed_after_wait"]
        loaded = found["loaded"]
        assert loaded.step == 1
        # What was saved is what the tensors held when save was called.
        assert torch.equal(loaded.state["model"]["w"], torch.arange(6.0))
        assert torch.equal(loaded.state["model"]["layers"][0], torch.ones(2))
        assert torch.equal(loaded.state["p"], torch.full((3,), 2.0))
        assert type(loaded.state["p"]) is torch.Tensor  # staged detached: no Parameter pickled
        assert set(loaded.rank_state) == {"gen", "rank"} and loaded.rank_state["rank"] == rank
        assert torch.equal(loaded.rank_state["gen"], torch.tensor([rank, 7]))
        assert found["step_2_committed_when_3_returned"], f"rank {rank}: two saves in flight"
        assert found["latest"] == "step-3\n"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-1", "step-2", "step-3"]


def _failures(ctx: RunContext, directory: str) -> dict[str, Any]:
    ckpt = local_backend(ctx=ctx, directory=Path(directory), options=ASYNC)
    folder = Path(directory) / "checkpoints"
    raised: dict[str, str | None] = {}

    def failure(call: Any) -> str | None:
        try:
            call()
        except CheckpointError as error:
            return str(error)
        return None

    # Rank 0 refuses the replicated state in the background: the next wait raises it.
    ckpt.save({"bad": Opaque()}, step=1, rank_state={})
    raised["wait"] = failure(ckpt.wait)
    raised["wait again"] = failure(ckpt.wait)  # raised once: nothing is in flight now
    # Only rank 1 cannot save its own state: the next save raises it, and starts nothing.
    ckpt.save({"w": torch.ones(2)}, step=2, rank_state={"bad": Opaque()} if ctx.rank else {})
    raised["save"] = failure(lambda: ckpt.save({"w": torch.ones(2)}, step=3, rank_state={}))
    raised["nothing started"] = failure(ckpt.wait)
    step_3_started = any(folder.glob("*step-3*"))
    # ... and load_latest raises it too.
    ckpt.save({"bad": Opaque()}, step=4, rank_state={})
    raised["load"] = failure(ckpt.load_latest)
    # A disk that fails under rank 1's writer only.
    real_write = storage(ckpt).write_file

    def disk_full(path: Path, obj: Mapping[str, Any]) -> FileRecord:
        if path.name == "rank-1.pt":
            raise OSError("disk full (simulated)")
        return real_write(path, obj)

    storage(ckpt).write_file = disk_full
    ckpt.save({"w": torch.ones(2)}, step=5, rank_state={})
    raised["disk"] = failure(ckpt.wait)
    storage(ckpt).write_file = real_write
    # Still usable.
    ckpt.save({"w": torch.full((2,), 6.0)}, step=6, rank_state={"rank": ctx.rank})
    ckpt.wait()
    loaded = ckpt.load_latest()
    return {"raised": raised, "step_3_started": step_3_started, "loaded": loaded}


@pytest.mark.slow
def test_a_background_failure_is_raised_on_every_rank_by_the_next_call(tmp_path: Path) -> None:
    results = run_ranks(_failures, 2, str(tmp_path), timeout_s=WAIT_S)
    for rank, found in enumerate(results):
        raised = found["raised"]
        assert raised["wait"] is not None, f"rank {rank}: wait did not raise"
        assert raised["wait"].startswith("saving checkpoint step 1 failed on rank 0:")
        assert "UnsafeCheckpointError" in raised["wait"]
        assert "weights_only=True refuses" in raised["wait"]
        assert raised["wait again"] is None
        assert raised["save"] is not None, f"rank {rank}: save did not raise"
        assert raised["save"].startswith("saving checkpoint step 2 failed on rank 1:")
        assert "UnsafeCheckpointError" in raised["save"]
        assert raised["nothing started"] is None and not found["step_3_started"]
        assert raised["load"] is not None and "saving checkpoint step 4 failed" in raised["load"]
        assert raised["disk"] is not None and raised["disk"].startswith(
            "saving checkpoint step 5 failed on rank 1: OSError: disk full (simulated)"
        )
        assert found["loaded"].step == 6 and found["loaded"].rank_state == {"rank": rank}
        assert torch.equal(found["loaded"].state["w"], torch.full((2,), 6.0))
    # No failed save left a folder.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-6"]


# ---------------------------------------------------------------------------------------------
# One process


def test_staging_copies_every_tensor_and_keeps_the_containers() -> None:
    param = torch.nn.Parameter(torch.ones(2))
    shared = torch.arange(4.0)
    state = {
        "model": OrderedDict(w=param, view=shared[1:3]),
        "pair": (shared, 3),
        "list": [shared, "name"],
        "step": 7,
    }
    staged = stage(state)
    assert type(staged["model"]) is OrderedDict and list(staged["model"]) == ["w", "view"]
    assert type(staged["pair"]) is tuple and type(staged["list"]) is list
    assert staged["pair"][1] == 3 and staged["list"][1] == "name" and staged["step"] == 7
    tensors = [staged["model"]["w"], staged["model"]["view"], staged["pair"][0], staged["list"][0]]
    assert not any(t.requires_grad for t in tensors) and type(tensors[0]) is torch.Tensor
    with torch.no_grad():
        param.mul_(3)
    shared.add_(10)
    assert torch.equal(staged["model"]["w"], torch.ones(2))
    assert torch.equal(staged["model"]["view"], torch.tensor([1.0, 2.0]))
    assert torch.equal(staged["pair"][0], torch.arange(4.0))
    for tensor in tensors:
        assert tensor.untyped_storage().data_ptr() not in {
            param.untyped_storage().data_ptr(),
            shared.untyped_storage().data_ptr(),
        }


def test_in_one_process_a_save_commits_by_wait(tmp_path: Path) -> None:
    ckpt = local_backend(ctx=RunContext(), directory=tmp_path, options=ASYNC)
    assert isinstance(ckpt, InBackground)
    ckpt.wait()  # nothing in flight
    w = torch.zeros(3)
    location = ckpt.save({"w": w}, step=4, rank_state={"mine": w})
    w.add_(1)
    ckpt.wait()
    assert location == str(tmp_path / "checkpoints" / "step-4")
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-4\n"
    loaded = ckpt.load_latest()
    assert loaded is not None and loaded.rank_state is not None
    assert torch.equal(loaded.state["w"], torch.zeros(3))
    assert torch.equal(loaded.rank_state["mine"], torch.zeros(3))


def test_a_stager_reuses_its_buffers_for_a_state_of_the_same_shapes() -> None:
    stager = Stager()
    model = OrderedDict(w=torch.ones(3), b=torch.zeros(2))
    first = stager.stage({"model": model, "step": 1})
    pointers = {k: t.data_ptr() for k, t in first["model"].items()}
    model["w"].add_(1)  # training goes on; the first copy was written, the next save begins
    second = stager.stage({"model": model, "step": 2})
    assert {k: t.data_ptr() for k, t in second["model"].items()} == pointers
    assert torch.equal(second["model"]["w"], torch.full((3,), 2.0)) and second["step"] == 2
    # A tensor of another shape gets a new buffer; buffers of keys gone are let go.
    third = stager.stage({"model": OrderedDict(w=torch.ones(4))})
    assert third["model"]["w"].data_ptr() != pointers["w"]
    assert torch.equal(third["model"]["w"], torch.ones(4))
    assert len(stager._buffers) == 1
