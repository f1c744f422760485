"""A cloud API key: read from the environment or from a file the user names, never from options
or a command line, and kept out of everything ups writes.

A launcher holds one :class:`ApiKey` and asks it for the key when it sends a request
(:meth:`ApiKey.read`), and to check a text it is about to show or hand to a machine
(:meth:`ApiKey.refuse_in`).
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from ups.core import UsageError


@attrs.define
class ApiKey:
    """Where a launcher's API key comes from: ``file`` when given, else ``$env``."""

    launcher: str
    """The launcher's name, which starts every message."""
    env: str
    file: str | Path | None = None
    _value: str | None = attrs.field(default=None, init=False, repr=False)

    @property
    def source(self) -> str:
        """Where the key is read from, for messages: ``$ENV`` or the file's path."""
        return f"${self.env}" if self.file is None else str(self.file)

    def read(self) -> str:
        """The key (read once, then remembered).

        :raises UsageError: the file cannot be read or is empty, or the variable is unset.
        """
        if self._value is None:
            if self.file is not None:
                path = Path(self.file).expanduser()
                try:
                    key = path.read_text().strip()
                except OSError as error:
                    raise UsageError(
                        f"{self.launcher}: cannot read api_key_file {self.file}: {error.strerror}"
                    ) from None
            else:
                key = os.environ.get(self.env, "").strip()
            if not key:
                raise UsageError(
                    f"{self.launcher}: no API key in {self.source}; set ${self.env} (never on a "
                    "command line) or name a file holding it in api_key_file"
                )
            self._value = key
        return self._value

    def refuse_in(self, text: str, what: str) -> None:
        """Raise :class:`UsageError` if ``text`` (``what``: e.g. "the start-up script") holds
        the key in clear text; a key that cannot be read is not looked for."""
        try:
            key = self.read()
        except UsageError:
            return
        if key in text:
            raise UsageError(
                f"{self.launcher}: {what} would contain the API key in clear text; keep it out "
                "of files, commands, options, paths and URLs"
            )
