"""Crashes: a rank killed (SIGKILL) at each stage of a ``local`` save. Damage found after the
commit (flipped bytes) is tested in ups-dist-core (``test_core_commit_faults.py``).

Each crash test runs two real ranks on a gloo process group that save steps 1 and 2, then
save step 3 with one rank set to kill itself at one point of the save. Nothing in ``ups.ckpt``
is changed for it: the rank that dies replaces, in its own process, a function the save calls
at that point (the storage's public ``write_file``, ``os.rename`` as
``ups.core.checkpoint._simple`` sees it, ...) by one that does part of the work and sends itself
``SIGKILL``. Its partner, stuck in a
collective, is then killed, as a launcher would. A fresh group of two ranks, and a single
process, must then load exactly the checkpoint the stage allows, bit for bit, and the next
save must succeed and sweep what the crash left.

The ranks are forked from ups's forkserver, which has imported torch once, so that each group
starts in a fraction of a second; their functions are module-level for it.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import queue as queue_module
import re
import signal
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import attrs
import pytest
import torch

import ups.core.checkpoint._commit
import ups.core.checkpoint._files
import ups.core.checkpoint._simple
from ups.ckpt import LocalCheckpointer, LocalCheckpointOptions
from ups.core import FileRecord, RunContext, distributed_session
from ups.core.launch._forkserver import start_method
from ups.core.testing import assert_bitwise_equal, free_port, torchrun_env

OPTIONS = LocalCheckpointOptions(keep_last=2)
TIMEOUT_S = 30.0

# ---------------------------------------------------------------------------------------------
# What is saved: values whose every bit is checked (a negative zero, NaN, infinities, bfloat16)


def replicated(step: int, attempt: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1000 * attempt + step)
    w = torch.randn(64, 32, generator=gen)
    w[0, :4] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")])
    return {
        "model": {"w": w, "b": torch.randn(32, generator=gen).to(torch.bfloat16)},
        "ids": torch.randint(0, 2**62, (5,), generator=gen),
        "step": step,
        "attempt": attempt,
    }


def own(step: int, rank: int, attempt: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7919 * (rank + 1) + 1000 * attempt + step)
    return {
        "generator": gen.get_state(),
        "noise": torch.rand(3, generator=gen, dtype=torch.float64),
        "rank": rank,
    }


def listing(folder: Path) -> list[str]:
    """The folder's entries, each random suffix shown as ``*``."""
    return sorted(re.sub(r"-[0-9a-f]{8}$", "-*", p.name) for p in folder.iterdir())


# ---------------------------------------------------------------------------------------------
# Ranks forked from a forkserver


def _context() -> Any:
    """ups's forkserver (``ups.core.launch._forkserver``), as ``run_ranks`` uses: one per process, so
    a forkserver of this module's own would leave every later test spawning its ranks."""
    return multiprocessing.get_context(start_method())


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple[Any, ...], queue: Any
) -> None:
    os.environ.update(torchrun_env(rank, world_size, port))
    try:
        with distributed_session(True, "gloo", TIMEOUT_S) as ctx:
            queue.put((rank, True, pickle.dumps(fn(ctx, *args))))
    except BaseException:  # reported to the test with its traceback
        queue.put((rank, False, traceback.format_exc()))


def _start(fn: Callable[..., Any], world_size: int, *args: Any) -> tuple[list[Any], Any]:
    context = _context()
    queue = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_rank_main, args=(fn, rank, world_size, port, args, queue))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    return procs, queue


def _reports(queue: Any, wanted: int, timeout_s: float) -> dict[int, tuple[bool, Any]]:
    """Up to ``wanted`` ranks' reports: ``(True, result)`` or ``(False, traceback)``."""
    found: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(found) < wanted:
        try:
            rank, ok, value = queue.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue_module.Empty:
            break
        found[rank] = (ok, pickle.loads(value) if ok else value)
    return found


def run_group(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``fn(ctx, *args)`` on every rank of a new group; each rank's result."""
    procs, queue = _start(fn, world_size, *args)
    try:
        results = _reports(queue, world_size, TIMEOUT_S + 10)
    finally:
        for proc in procs:  # done, or failed: tearing the group down would only take time
            proc.kill()
            proc.join(timeout=10)
    for rank in range(world_size):
        assert rank in results, f"rank {rank} did not finish"
        ok, value = results[rank]
        assert ok, f"rank {rank} failed:\n{value}"
    return [results[rank][1] for rank in range(world_size)]


def run_until_killed(fn: Callable[..., Any], world_size: int, victim: int, *args: Any) -> None:
    """Run ``fn`` on a new group until rank ``victim`` dies of SIGKILL; then kill the others,
    as a launcher does when one of its processes dies."""
    procs, queue = _start(fn, world_size, *args)
    try:
        procs[victim].join(timeout=TIMEOUT_S + 10)
        exitcode = procs[victim].exitcode
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
    if exitcode != -signal.SIGKILL:
        reports = _reports(queue, world_size, 1)
        raise AssertionError(
            f"rank {victim} ended with exit code {exitcode}, not by SIGKILL: {reports}"
        )


# ---------------------------------------------------------------------------------------------
# The crash stages, each installed in the dying rank's own process


CHILD = pytest.MonkeyPatch()
"""Replaces functions in the dying rank's process, which never undoes them."""


def die() -> NoReturn:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached: SIGKILL to oneself is delivered at once
    raise AssertionError("not killed")


class Patched:
    """A module's view of another (``os``, ``shutil``) with some functions replaced."""

    def __init__(self, module: Any, **replaced: Callable[..., Any]) -> None:
        self._module, self._replaced = module, replaced

    def __getattr__(self, name: str) -> Any:
        return self._replaced.get(name) or getattr(self._module, name)


def half_written(ckpt: LocalCheckpointer, name: str) -> None:
    """Die half way through writing the file ``name``: half its bytes are on disk."""
    real_write = ckpt.storage.write_file

    def write(path: Path, obj: Mapping[str, Any]) -> FileRecord:
        if path.name != name:
            return real_write(path, obj)
        buffer = io.BytesIO()
        torch.save(dict(obj), buffer)
        with open(path, "xb") as file:
            file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            file.flush()
            os.fsync(file.fileno())
        die()

    ckpt.storage.write_file = write


def writing_state(ckpt: LocalCheckpointer) -> None:
    half_written(ckpt, "state.pt")


def writing_rank_file(ckpt: LocalCheckpointer) -> None:
    half_written(ckpt, "rank-1.pt")


def writing_commit(_: LocalCheckpointer) -> None:
    def write_new(path: Path, text: str) -> None:
        assert path.name == "COMMIT"
        with open(path, "x") as file:
            file.write(text[: len(text) // 2])
            file.flush()
            os.fsync(file.fileno())
        die()

    CHILD.setattr(ups.core.checkpoint._simple, "_write_new", write_new)


def renaming_into_place(_: LocalCheckpointer) -> None:
    def rename(src: Any, dst: Any) -> None:
        if Path(src).name.startswith(".tmp-step-3-"):
            die()
        os.rename(src, dst)

    CHILD.setattr(ups.core.checkpoint._simple, "os", Patched(os, rename=rename))


def before_latest(_: LocalCheckpointer) -> None:
    def write_atomically(path: Path, text: str) -> None:
        assert path.name == "latest"
        die()

    CHILD.setattr(ups.core.checkpoint._simple, "write_atomically", write_atomically)


def replacing_latest(_: LocalCheckpointer) -> None:
    """In ``write_atomically``, once the new content is in its temporary file."""

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).name == "latest":
            die()
        os.replace(src, dst)

    CHILD.setattr(ups.core.checkpoint._files, "os", Patched(os, replace=replace))


def before_retention(_: LocalCheckpointer) -> None:
    def prune(*args: Any, **kwargs: Any) -> NoReturn:
        die()

    CHILD.setattr(ups.core.checkpoint._commit, "prune", prune)


def during_retention(_: LocalCheckpointer) -> None:
    """Deleting step-1: renamed out of sight, one file of it deleted."""
    import shutil

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).name.startswith(".trash-step-1-"):
            (Path(path) / "state.pt").unlink()
            die()
        shutil.rmtree(path, *args, **kwargs)

    CHILD.setattr(ups.core.checkpoint._simple, "shutil", Patched(shutil, rmtree=rmtree))


def replacing_a_step_saved_before(_: LocalCheckpointer) -> None:
    """Saving step 3 again: the old step-3 deleted, the new one not renamed into place."""
    real_remove = ups.core.checkpoint._simple._remove

    def remove(path: Path, folder: Path) -> None:
        real_remove(path, folder)
        if path.name == "step-3":
            die()

    CHILD.setattr(ups.core.checkpoint._simple, "_remove", remove)


@attrs.frozen
class Stage:
    inject: Callable[[LocalCheckpointer], None]
    """Set the dying rank to die at the stage, given its checkpointer."""
    victim: int
    """The rank that dies."""
    left: list[str]
    """The folder's listing after the crash."""
    latest: str
    """What ``latest`` names after the crash."""
    loads: int
    """The step loaded after the crash."""
    before: tuple[int, ...] = (1, 2)
    """The steps saved before the one that crashes (step 3)."""


_TMP_LEFT = [".tmp-step-3-*", "latest", "step-1", "step-2"]
STAGES = {
    "rank 0 writing state.pt": Stage(writing_state, 0, _TMP_LEFT, "step-2", loads=2),
    "rank 1 writing rank-1.pt": Stage(writing_rank_file, 1, _TMP_LEFT, "step-2", loads=2),
    "writing COMMIT": Stage(writing_commit, 0, _TMP_LEFT, "step-2", loads=2),
    "after COMMIT, before the rename": Stage(renaming_into_place, 0, _TMP_LEFT, "step-2", loads=2),
    # Renamed: step-3 is committed, but `latest` still names step-2, which loads (`latest`
    # decides, as when a run resumed from an older step saves over a newer one).
    "after the rename, before latest": Stage(
        before_latest, 0, ["latest", "step-1", "step-2", "step-3"], "step-2", loads=2
    ),
    "replacing latest": Stage(
        replacing_latest, 0, [".latest-*", "latest", "step-1", "step-2", "step-3"], "step-2", 2
    ),
    "after latest, before retention": Stage(
        before_retention, 0, ["latest", "step-1", "step-2", "step-3"], "step-3", loads=3
    ),
    "during retention": Stage(
        during_retention, 0, [".trash-step-1-*", "latest", "step-2", "step-3"], "step-3", 3
    ),
    # `latest` names the deleted step-3: the newest committed one loads.
    "saving a step again, between delete and rename": Stage(
        replacing_a_step_saved_before,
        0,
        [".tmp-step-3-*", "latest", "step-2"],
        "step-3",
        loads=2,
        before=(1, 2, 3),
    ),
}


def _save_then_crash(ctx: RunContext, directory: str, stage: str) -> str:
    ckpt = LocalCheckpointer(ctx=ctx, directory=Path(directory), options=OPTIONS)
    for step in STAGES[stage].before:
        ckpt.save(replicated(step), step=step, rank_state=own(step, ctx.rank))
    if ctx.rank == STAGES[stage].victim:
        STAGES[stage].inject(ckpt)
    ckpt.save(replicated(3, attempt=1), step=3, rank_state=own(3, ctx.rank, attempt=1))
    return "survived"


def _resume_and_save(ctx: RunContext, directory: str) -> dict[str, Any]:
    ckpt = LocalCheckpointer(ctx=ctx, directory=Path(directory), options=OPTIONS)
    loaded = ckpt.load_latest()
    assert loaded is not None
    step = loaded.step + 1
    location = ckpt.save(replicated(step, 2), step=step, rank_state=own(step, ctx.rank, 2))
    again = ckpt.load_latest()
    assert again is not None
    return {"loaded": loaded, "location": location, "again": again}


@pytest.fixture
def crashed(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Stage, Path]:
    stage = STAGES[request.param]
    run_until_killed(_save_then_crash, 2, stage.victim, str(tmp_path), request.param)
    return stage, tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("crashed", list(STAGES), indirect=True)
def test_a_rank_killed_while_saving_loses_at_most_that_save(crashed: tuple[Stage, Path]) -> None:
    stage, directory = crashed
    folder = directory / "checkpoints"
    assert listing(folder) == stage.left
    assert (folder / "latest").read_text() == f"{stage.latest}\n"
    # The crashed save (of step 3) was attempt 1: it loads only when it got past `latest`.
    attempt = 1 if stage.loads == 3 else 0
    expected = replicated(stage.loads, attempt)

    # A single process: the state only.
    alone = LocalCheckpointer(ctx=RunContext(), directory=directory, options=OPTIONS)
    loaded = alone.load_latest()
    assert loaded is not None
    assert (loaded.step, loaded.location) == (stage.loads, str(folder / f"step-{stage.loads}"))
    assert_bitwise_equal(loaded.state, expected)
    assert loaded.rank_state is None  # saved by two ranks

    # Two ranks: each its own state too; then the next save commits and sweeps the leftovers.
    results = run_group(_resume_and_save, 2, str(directory))
    following = stage.loads + 1
    for rank, result in enumerate(results):
        assert result["loaded"].step == stage.loads
        assert_bitwise_equal(result["loaded"].state, expected)
        assert_bitwise_equal(
            result["loaded"].rank_state, own(stage.loads, rank, attempt), f"rank {rank}"
        )
        assert result["location"] == str(folder / f"step-{following}")
        assert result["again"].step == following
        assert_bitwise_equal(result["again"].state, replicated(following, 2))
        assert_bitwise_equal(result["again"].rank_state, own(following, rank, 2), f"rank {rank}")
    assert [n for n in listing(folder) if not n.startswith(".latest-")] == [
        "latest",
        f"step-{stage.loads}",
        f"step-{following}",
    ]
