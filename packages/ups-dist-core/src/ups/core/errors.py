"""The errors ups raises for a user's mistakes, as opposed to bugs."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UsageError(Exception):
    """A mistake in the user's input: a bad config key or value, an unknown plugin, a missing file.

    The CLI prints its message on one line and exits with status 2, without a traceback.
    """


class ConfigError(UsageError):
    """A bad value at a key path of the configuration."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path else problem)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str]]:
        """Pickled by its arguments (to another process), not by its message."""
        return type(self), (self.path, self.problem)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ``"; did you mean 'x'?"`` for the closest of ``choices``, or ``""`` if none is close
    (case aside: ``PowerSGD`` is close to ``powersgd``)."""
    by_lower = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f"; did you mean {by_lower[close[0]]!r}?" if close else ""


def one_of(choices: Iterable[str]) -> str:
    """Render allowed values as ``a, b, c`` (sorted), or ``(none)``."""
    names = sorted(choices)
    return ", ".join(names) if names else "(none)"
