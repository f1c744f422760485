"""The ``local`` backend: the built-in ``simple`` backend's folders, each rank writing its own.

The layout under the run's folder (``checkpoints/step-<N>/`` with ``state.pt``, a
``rank-<r>.pt`` per rank and ``COMMIT``; ``latest``), the commit rule, the verification and the
loading are ``simple``'s (:mod:`ups.core.checkpoint`, the commit protocol of
:mod:`ups.core.checkpoint` over a folder). A save is a collective every rank enters: rank 0 makes
the temporary folder; every rank writes and fsyncs its own files there (where ``simple``
gathers them to rank 0), so the folder must be on a filesystem every rank sees (one machine,
or a shared filesystem); all ranks learn whether any rank failed; rank 0 writes ``COMMIT``,
fsyncs the folder, renames it to ``step-<N>`` and replaces ``latest``. A folder without a
readable ``COMMIT`` is never loaded. Beyond ``simple``: three checkpoints kept by default, and
``async_save`` to write in the background (:class:`~ups.ckpt.InBackground`).
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
