"""What a job's machines uploaded, read here: each machine's run folder at ``upload_url``
(machine R > 0 at ``<upload_url>/nodes/R``: :func:`ups.cloud._startup.node_upload_url`), its exit
status (``startup.exit``) written last, so that its presence says the rest is there.
"""

from __future__ import annotations

from ._options import check_readable_here
from ._startup import EXIT_FILE, node_upload_url

READS_UPLOAD = "reading it here (ups status, ups logs)"
"""Why this process needs to read ``upload_url``, for the message when it cannot."""


def read_upload(url: str | None, name: str, rank: int = 0) -> str | None:
    """The text of the file ``name`` machine ``rank`` uploaded to ``url``; ``None`` without a
    ``url`` or while it is not there.

    :raises ConfigError: this process cannot read ``url`` (naming what to install).
    """
    folder = node_upload_url(url, rank)
    if url is None or folder is None:
        return None
    check_readable_here(url, READS_UPLOAD)
    import fsspec  # type: ignore[import-untyped, unused-ignore]

    try:
        with fsspec.open(f"{folder.rstrip('/')}/{name}", "r") as file:
            return str(file.read())
    except FileNotFoundError:
        return None


def uploaded(url: str | None, nnodes: int) -> bool:
    """Whether each of the ``nnodes`` machines has uploaded its run folder (its exit status)."""
    return all(read_upload(url, EXIT_FILE, rank) is not None for rank in range(nnodes))
