"""A checkpointer from a folder or URL and options: what the engine builds for ``checkpoint:``.

The options are the backends' own classes and the factory called is the one the engine calls
(:mod:`ups.ckpt.plugin`), so checkpoints saved in a loop of one's own are laid out, committed,
kept and verified exactly as ``ups train``'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ups.core import Checkpointer, ConfigError, RunContext, structure
from ups.core.config import boolean, check_type

from .plugin import ups_checkpoint_backends


def checkpointer(
    location: str | os.PathLike[str], *, ctx: RunContext, sharded: bool = False, **options: Any
) -> Checkpointer:
    """Checkpoints under ``location``: a folder (``<location>/checkpoints/step-<N>/``, made when
    missing) or a URL (``s3://bucket/run1``, through fsspec).

    What it returns is a collective object: every rank builds it, and every rank calls its
    ``save(state, step=, rank_state=)`` (``state``: what every rank holds alike, such as the
    model's and optimizer's state dicts, written by rank 0; ``rank_state``: each rank's own),
    ``load_latest()`` (the newest committed checkpoint that verifies, or ``None``) and
    ``wait()`` (every save committed). A save is atomic: a checkpoint that a crash interrupts is
    never loaded. Loading uses ``torch.load(weights_only=True)``, and a state that it would
    refuse is refused when saved.

    :param ctx: this rank's run context (:func:`ups.core.distributed_session`).
    :param sharded: each rank writes its share of ``state`` with torch DCP (a folder only).
    :param options: ``keep_last`` (3; ``None``: all), ``keep_every`` (also keep every
        multiple of it), ``async_save`` (write in the background: ``save`` returns once the
        state is copied); for a URL, ``storage_options`` (passed to fsspec).
    :raises ConfigError: naming the argument: ``location`` that is a file, an unknown option
        or one of the wrong type; for an argument of the wrong type, an
        :class:`~ups.core.config.ArgumentTypeError` (a ``TypeError`` too).
    """
    check_type("location", location, str | os.PathLike, "a folder's path or a URL")
    check_type("ctx", ctx, RunContext, "a RunContext (from ups.core.distributed_session)")
    boolean("sharded", sharded)
    backends = {record.name: record for record in ups_checkpoint_backends()}
    text = os.fspath(location)
    if "://" in text:
        if sharded:
            raise ConfigError("sharded", f"is for a folder, not a URL like {text!r}")
        record, directory, options = backends["fsspec"], Path.cwd(), {**options, "url": text}
    else:
        directory = Path(text)
        if directory.exists() and not directory.is_dir():
            raise ConfigError(
                "location",
                f"{text} is a file; give a folder (made when missing) or a URL (s3://...)",
            )
        try:
            directory.mkdir(parents=True, exist_ok=True)  # now: a folder that cannot be, named
        except OSError as error:
            raise ConfigError("location", f"cannot make the folder {text}: {error}") from error
        record = backends["sharded" if sharded else "local"]
    record = record.loaded()
    built: Any = structure(record.options, options)
    checkpoints: Checkpointer = record.factory(ctx=ctx, directory=directory, options=built)
    return checkpoints
