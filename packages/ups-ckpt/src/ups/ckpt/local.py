"""The ``local`` checkpoint backend: one folder per checkpoint, committed atomically.

Layout under the run's folder::

    checkpoints/
        step-100/           a committed checkpoint
            state.pt        the replicated state, written by rank 0
            rank-0.pt       what each rank keeps of its own (its RNG state)
            rank-1.pt
            COMMIT          the manifest, written last: step, world size, files and sizes
        latest              the name of the newest checkpoint ("step-100"), replaced atomically
        .tmp-step-150-1f2e  a save in progress, or one that crashed: never loaded

A save is a collective every rank enters. Rank 0 makes the temporary folder; every rank writes
and fsyncs its files there; all ranks learn whether any rank failed; rank 0 writes ``COMMIT``,
fsyncs the folder, renames it to ``step-<N>`` and replaces ``latest``. A folder without a
readable ``COMMIT`` is never loaded, and a failure on any rank raises on every rank, naming it.
Every file is read with ``torch.load(weights_only=True)``: a file that would run code is refused.
The folder must be on a filesystem every rank sees (one machine, or a shared filesystem).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

import attrs
import structlog
import torch

from ups.core import RankFailedError, RunContext, at_least, decide, gather_failures
from ups.core.files import fsync_dir, write_atomically

log = structlog.get_logger()

T = TypeVar("T")

CHECKPOINTS = "checkpoints"
"""The folder, inside the run's folder, that holds the checkpoints."""
STATE_FILE = "state.pt"
COMMIT_FILE = "COMMIT"
LATEST_FILE = "latest"
FORMAT = 1
"""The version of the manifest in ``COMMIT``."""
RNG_KEY = "rank_rng_state"
"""The key :meth:`LocalCheckpointer.load_latest` puts this rank's saved RNG state under.

A mapping ``{"torch": ByteTensor}``, plus ``"cuda"`` when the rank computed on a CUDA device;
:func:`restore_rng` applies it. A state saved with this key is refused: the key is reserved.
"""

_STEP_DIR = re.compile(r"step-(\d+)")
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class CheckpointError(RuntimeError):
    """Saving or loading a checkpoint failed; raised on every rank, naming the failing ranks."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds objects that loading would have to run code to rebuild."""


@attrs.frozen(kw_only=True)
class LocalCheckpointOptions:
    """Options of the ``local`` backend."""

    keep_last: int = attrs.field(default=3, validator=at_least(1))
    """How many committed checkpoints to keep; older ones are deleted after a save commits.
    The checkpoint ``latest`` names is never deleted."""


@attrs.frozen(kw_only=True)
class Manifest:
    """The content of a ``COMMIT`` file."""

    step: int
    world_size: int
    files: dict[str, int]
    """Every file of the checkpoint (but ``COMMIT``) and its size in bytes."""
    saved_at: str = ""
    """When rank 0 committed it, ISO 8601 in UTC."""
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse a manifest; raise ``ValueError`` when it is not one."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a format-{FORMAT} manifest")
        step, world_size, files = data.get("step"), data.get("world_size"), data.get("files")
        if not (_is_int(step) and step >= 0 and _is_int(world_size) and world_size >= 1):
            raise ValueError("step or world_size is missing or not a valid integer")
        if not isinstance(files, dict) or not all(
            isinstance(name, str) and _FILE_NAME.fullmatch(name) and _is_int(size) and size >= 0
            for name, size in files.items()
        ):
            raise ValueError("files must map plain file names to sizes")
        return cls(
            step=step, world_size=world_size, files=files, saved_at=str(data.get("saved_at", ""))
        )


@attrs.frozen
class Committed:
    """A committed checkpoint folder and its manifest."""

    path: Path
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step


class LocalCheckpointer:
    """Keeps checkpoints as ``<run dir>/checkpoints/step-<N>/`` folders (see the module doc)."""

    def __init__(
        self, *, ctx: RunContext, directory: Path, options: LocalCheckpointOptions
    ) -> None:
        self.ctx = ctx
        self.folder = Path(directory) / CHECKPOINTS
        self.options = options

    # -- the Checkpointer protocol ------------------------------------------------------------

    def save(self, state: Mapping[str, Any], *, step: int) -> str:
        """Save rank 0's ``state`` and every rank's :meth:`rank_state` as checkpoint ``step``.

        A collective: every rank calls it. Returns the committed folder's path on every rank.

        :raises CheckpointError: on every rank, naming the ranks that failed and why.
        """
        what = f"saving checkpoint step {step}"
        tmp = Path(self._on_main(what, lambda: str(self._begin(state, step))))
        error: Exception | None = None
        try:
            if self.ctx.is_main:
                _write(tmp / STATE_FILE, dict(state), verify=True)
            _write(tmp / _rank_file(self.ctx.rank), self.rank_state())
        except Exception as caught:  # every rank learns of it below
            error = caught
        try:
            _agree(self.ctx, what, error)
        except CheckpointError:
            if self.ctx.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self._on_main(what, lambda: self._commit(tmp, step))

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """Load the checkpoint ``latest`` names (else the newest committed one), on every rank.

        Returns ``None`` when there is none. The state comes back as saved by rank 0, plus this
        rank's RNG state under :data:`RNG_KEY` when the checkpoint was saved by as many ranks
        as there are now (else without it, and a warning).

        :raises CheckpointError: on every rank, when any rank cannot read it.
        :raises UnsafeCheckpointError: when a file would run code to load (on every rank).
        """
        found = self._on_main("finding the latest checkpoint", self._find_latest)
        if found is None:
            return None
        path_text, step, saved_world = found
        path = Path(path_text)
        state: dict[str, Any] = {}
        error: Exception | None = None
        try:
            state = _read_dict(path / STATE_FILE)
            if saved_world == self.ctx.world_size:
                own = _read_dict(path / _rank_file(self.ctx.rank))
                if "rng" not in own:
                    raise CheckpointError(f"{path / _rank_file(self.ctx.rank)} has no RNG state")
                state[RNG_KEY] = own["rng"]
        except Exception as caught:  # every rank learns of it below
            error = caught
        _agree(self.ctx, f"loading checkpoint {path}", error)
        if saved_world != self.ctx.world_size and self.ctx.is_main:
            log.warning(
                "checkpoint saved by another number of ranks; per-rank RNG states not restored",
                checkpoint=str(path),
                saved_world_size=saved_world,
                world_size=self.ctx.world_size,
            )
        return step, state

    # -- extension points ---------------------------------------------------------------------

    def rank_state(self) -> dict[str, Any]:
        """What this rank saves of its own, in ``rank-<rank>.pt``: its RNG state, for now."""
        rng: dict[str, torch.Tensor] = {"torch": torch.get_rng_state()}
        if self.ctx.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.ctx.device)
        return {"rank": self.ctx.rank, "world_size": self.ctx.world_size, "rng": rng}

    def committed(self) -> list[Committed]:
        """The committed checkpoints in the folder, oldest step first (read on this rank)."""
        found = []
        for path in self.folder.glob("step-*"):
            if _STEP_DIR.fullmatch(path.name) and path.is_dir():
                manifest = _read_manifest(path)
                if manifest is not None:
                    found.append(Committed(path, manifest))
        return sorted(found, key=lambda c: c.step)

    # -- rank 0's parts -----------------------------------------------------------------------

    def _on_main(self, what: str, action: Callable[[], T]) -> T:
        """Run ``action`` on rank 0 and hand its result (or failure) to every rank."""
        try:
            return decide(self.ctx, action)
        except RankFailedError as error:
            raise CheckpointError(f"{what} failed: {error}") from error
        except Exception as error:  # not distributed: decide ran it here
            raise CheckpointError(f"{what} failed: {_describe(error)}") from error

    def _begin(self, state: Mapping[str, Any], step: int) -> Path:
        if not _is_int(step) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if RNG_KEY in state:
            raise ValueError(f"the state key {RNG_KEY!r} is reserved for per-rank RNG states")
        if not self.folder.is_dir():
            self.folder.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.folder.parent)
        while True:
            tmp = self.folder / f".tmp-step-{step}-{secrets.token_hex(4)}"
            try:
                tmp.mkdir()
            except FileExistsError:
                continue
            return tmp

    def _commit(self, tmp: Path, step: int) -> str:
        final = self.folder / f"step-{step}"
        try:
            files = {}
            for rank in range(self.ctx.world_size):
                name = _rank_file(rank)
                if not (tmp / name).is_file():
                    raise CheckpointError(
                        f"{tmp / name} is missing although rank {rank} wrote it: is "
                        f"{self.folder} on a filesystem every rank shares?"
                    )
            for path in sorted(tmp.iterdir()):
                files[path.name] = path.stat().st_size
            manifest = Manifest(
                step=step,
                world_size=self.ctx.world_size,
                files=files,
                saved_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            )
            _write_new(tmp / COMMIT_FILE, manifest.to_json())
            fsync_dir(tmp)
            if final.exists():
                # Saving a step again (after resuming): the new checkpoint replaces the old.
                _remove(final, self.folder)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(self.folder)
        write_atomically(self.folder / LATEST_FILE, final.name + "\n")
        self._retain(protect=final.name)
        return str(final)

    def _retain(self, protect: str) -> None:
        committed = {c.step: c for c in self.committed()}
        protected = _step_of(protect)
        for step in expired(list(committed), self.options.keep_last, protected):
            try:
                _remove(committed[step].path, self.folder)
            except OSError as error:
                log.warning(
                    "could not delete an old checkpoint",
                    checkpoint=str(committed[step].path),
                    error=_describe(error),
                )
            else:
                log.debug("old checkpoint deleted", checkpoint=str(committed[step].path))

    def _find_latest(self) -> tuple[str, int, int] | None:
        committed = self.committed()
        if not committed:
            return None
        pointer = _read_latest(self.folder)
        chosen = next((c for c in committed if c.path.name == pointer), None)
        if chosen is None:
            chosen = committed[-1]
            if pointer is not None:
                log.warning(
                    "'latest' names no committed checkpoint; loading the newest committed one",
                    latest=pointer,
                    checkpoint=str(chosen.path),
                )
        for name, size in chosen.manifest.files.items():
            path = chosen.path / name
            actual = path.stat().st_size if path.is_file() else None
            if actual != size:
                found = "is missing" if actual is None else f"has {actual} bytes"
                raise CheckpointError(
                    f"{path} {found} but COMMIT says {size} bytes: the checkpoint is damaged; "
                    "move it away to resume from an older one"
                )
        return str(chosen.path), chosen.step, chosen.manifest.world_size


def expired(steps: Sequence[int], keep_last: int, protected: int | None = None) -> list[int]:
    """The committed steps retention deletes: all but the newest ``keep_last``, never
    ``protected`` (the one ``latest`` names). Oldest first."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    ordered = sorted(set(steps))
    return [step for step in ordered[:-keep_last] if step != protected]


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set this process's torch (and CUDA) RNG from ``state[RNG_KEY]``, if it is there."""
    rng = state.get(RNG_KEY)
    if rng is None:
        return
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


# ---------------------------------------------------------------------------------------------
# Agreement across ranks

_ERRORS: dict[str, type[CheckpointError]] = {
    "UnsafeCheckpointError": UnsafeCheckpointError,
}


def _agree(ctx: RunContext, what: str, error: Exception | None) -> None:
    """Tell every rank which ranks failed ``what``; if any did, raise on every rank.

    The error names the failing ranks and their messages. It is an
    :class:`UnsafeCheckpointError` when every failing rank failed with one, else a
    :class:`CheckpointError`. A collective: every rank calls it, failed or not.
    """
    failed = gather_failures(ctx, error)
    if not failed:
        return
    kinds = {f.kind for f in failed}
    cls = _ERRORS.get(kinds.pop(), CheckpointError) if len(kinds) == 1 else CheckpointError
    ranks = ", ".join(str(f.rank) for f in failed)
    details = "; ".join(f"rank {f.rank}: {f.kind}: {f.message}" for f in failed)
    raise cls(f"{what} failed on rank{'s' if len(failed) > 1 else ''} {ranks}: {details}") from (
        error
    )


# ---------------------------------------------------------------------------------------------
# Files


def _rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


def _write(path: Path, obj: dict[str, Any], *, verify: bool = False) -> None:
    """``torch.save`` ``obj`` to a new file and fsync it; with ``verify``, check it loads back
    with ``weights_only=True`` (memory-mapped, so tensor data is not read)."""
    with open(path, "xb") as file:
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())
    if verify:
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(
                f"the state holds objects that loading with weights_only=True refuses "
                f"({_unpickling_reason(error)}); save tensors, numbers, strings and "
                "lists/dicts of them"
            ) from None


def _read_dict(path: Path) -> dict[str, Any]:
    """Load a checkpoint file with ``weights_only=True``; refuse one that would run code."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"refusing to load {path}: it holds objects that loading would have to run code "
            f"for ({_unpickling_reason(error)}); only tensors, numbers, strings and "
            "containers of them are loaded"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a state dict")
    return obj


def _unpickling_reason(error: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only message that says what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line or "unsupported" in line:
            return line.rstrip(".")
    return lines[-1].rstrip(".") if lines else "unsupported pickle content"


def _read_manifest(path: Path) -> Manifest | None:
    """The manifest of a checkpoint folder, or ``None`` when it is not committed."""
    try:
        text = (path / COMMIT_FILE).read_text()
    except FileNotFoundError:
        return None
    try:
        manifest = Manifest.from_json(text)
    except ValueError as error:
        log.warning("unreadable COMMIT; checkpoint ignored", checkpoint=str(path), error=str(error))
        return None
    if f"step-{manifest.step}" != path.name:
        log.warning(
            "COMMIT names another step; checkpoint ignored",
            checkpoint=str(path),
            step=manifest.step,
        )
        return None
    return manifest


def _read_latest(folder: Path) -> str | None:
    try:
        name = (folder / LATEST_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    return name if _STEP_DIR.fullmatch(name) else None


def _step_of(name: str) -> int | None:
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def _write_new(path: Path, text: str) -> None:
    """Write ``text`` durably into a file that must not exist yet."""
    with open(path, "x") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    fsync_dir(path.parent)


def _remove(path: Path, folder: Path) -> None:
    """Delete a checkpoint folder: first rename it out of sight, so it never looks committed
    while half deleted."""
    trash = folder / f".trash-{path.name}-{secrets.token_hex(4)}"
    os.rename(path, trash)
    shutil.rmtree(trash)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
