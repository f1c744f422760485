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


def one_line(error: BaseException, limit: int = 600) -> str:
    """``Type: message`` of ``error`` on one line (whitespace collapsed) and, when it was raised
    from or while handling another error, `` <- Type: message`` of the root cause, the end of
    that chain: what failed, then why. Over ``limit`` characters, the middle is cut
    (`` ... ``), so that both ends stay."""
    root, seen = error, {id(error)}
    while (below := _cause(root)) is not None and id(below) not in seen:  # a chain may loop
        root = below
        seen.add(id(below))
    parts = [error] if root is error else [error, root]
    text = " <- ".join(" ".join(f"{type(e).__name__}: {e}".split()) for e in parts)
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]} ... {text[len(text) - half :]}"


def _cause(error: BaseException) -> BaseException | None:
    """The error ``error`` was raised from, or while handling (unless ``from None``)."""
    return error.__cause__ or (None if error.__suppress_context__ else error.__context__)
