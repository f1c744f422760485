"""``one_line``: an error and its root cause on one line, both ends kept when it is long."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ups.core import one_line


def chained(messages: list[str]) -> BaseException:
    """A chain of errors, the first raised from the second, ... (the last: the root cause)."""
    below: BaseException | None = None
    for message in reversed(messages):
        try:
            raise RuntimeError(message) from below
        except RuntimeError as error:
            below = error
    assert below is not None
    return below


def test_the_root_cause_is_kept_past_a_long_message() -> None:
    error = chained(["API request to http://host/x failed\n" + "x" * 2000, "Connection refused"])
    text = one_line(error)
    assert text.startswith("RuntimeError: API request to http://host/x failed x")
    assert text.endswith("<- RuntimeError: Connection refused")
    assert len(text) <= 600 and "\n" not in text


def raised(suppress: bool) -> BaseException:
    """A ValueError raised while handling an OSError, ``from None`` if ``suppress``."""
    try:
        try:
            raise OSError("disk gone")
        except OSError:
            if suppress:
                raise ValueError("cannot save") from None
            raise ValueError("cannot save")  # noqa: B904 - the implicit context is the point
    except ValueError as error:
        return error
    raise AssertionError("unreachable")


def test_an_error_raised_while_handling_another_names_it_unless_suppressed() -> None:
    assert one_line(raised(suppress=True)) == "ValueError: cannot save"
    assert one_line(raised(suppress=False)) == "ValueError: cannot save <- OSError: disk gone"


def test_a_chain_that_loops_back_ends() -> None:
    first, second = RuntimeError("a"), RuntimeError("b")
    first.__cause__, second.__cause__ = second, first
    assert one_line(first) == "RuntimeError: a <- RuntimeError: b"


@given(
    st.lists(st.text(min_size=0, max_size=400), min_size=1, max_size=5),
    st.integers(min_value=40, max_value=800),
)
def test_one_line_within_the_limit_keeping_both_ends(messages: list[str], limit: int) -> None:
    text = one_line(chained(messages), limit)
    assert "\n" not in text and "\r" not in text
    assert len(text) <= limit
    full = one_line(chained(messages), 10**9)
    assert text == full or (
        text.startswith(full[: (limit - 5) // 2]) and text.endswith(full[-((limit - 5) // 2) :])
    )
    assert full.endswith(" ".join(f"RuntimeError: {messages[-1]}".split()))
