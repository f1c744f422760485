"""The ``local`` backend: the built-in ``simple`` backend's folders, with more options.

Layout under the run's folder, commit rule, verification and loading are ``simple``'s
(:mod:`ups.core.simple_checkpoint`, over the commit protocol of :mod:`ups.core.commit`), but
for who writes: each rank writes its own file, where ``simple`` gathers them to rank 0::

    checkpoints/
        step-100/           a committed checkpoint
            state.pt        the replicated state, written by rank 0
            rank-0.pt       what each rank keeps of its own (its RNG state)
            rank-1.pt
            COMMIT          the manifest, written last: step, world size, files, sizes, CRC-32s
        latest              the name of the newest checkpoint ("step-100"), replaced atomically
        .tmp-step-150-1f2e  a save in progress, or one that crashed: never loaded

A save is a collective every rank enters. Rank 0 makes the temporary folder; every rank writes
and fsyncs its files there; all ranks learn whether any rank failed; rank 0 writes ``COMMIT``,
fsyncs the folder, renames it to ``step-<N>`` and replaces ``latest``. A folder without a
readable ``COMMIT`` is never loaded, and a failure on any rank raises on every rank, naming it.
Loading takes the checkpoint ``latest`` names if its files match the manifest's sizes and
CRC-32s, else the newest that does (with a warning naming what is damaged). Every file is read
with ``torch.load(weights_only=True)``: a file that would run code is refused. The folder must be
on a filesystem every rank sees (one machine, or a shared filesystem). Beyond ``simple``:
``keep_every``, and ``async_save`` to write in the background (:mod:`ups.ckpt.background`).
"""

from __future__ import annotations

import attrs

from ups.core import SimpleCheckpointer, SimpleCheckpointOptions, at_least


@attrs.frozen(kw_only=True)
class LocalCheckpointOptions(SimpleCheckpointOptions):
    """Options of the ``local`` backend: ``simple``'s, keeping 3 by default, and ``async_save``."""

    keep_last: int | None = attrs.field(default=3, validator=at_least(1))
    """How many of the newest committed checkpoints to keep; older ones are deleted after a
    save commits (``null``: keep all). The checkpoint ``latest`` names is never deleted."""
    async_save: bool = False
    """Write in the background: ``save`` returns once the state is copied, and training goes
    on while it is written and committed (one save in flight at a time)."""


class LocalCheckpointer(SimpleCheckpointer):
    """Keeps checkpoints as ``<run dir>/checkpoints/step-<N>/`` folders (see the module doc):
    :class:`~ups.core.SimpleCheckpointer` given ``local``'s options.

    ``group``: the process group its collectives use (``None``: the default one); a background
    saver gives it one of its own.
    """

    gathers_rank_states = False  # every rank writes its own file: the folder is shared
    options: LocalCheckpointOptions
