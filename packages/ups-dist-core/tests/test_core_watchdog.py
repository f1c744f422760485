"""The step watchdog's verdict, and its exchange of marks over a real 2-rank job's store."""

from __future__ import annotations

import attrs

from ups.core import RunContext
from ups.core.context import collective_timeout
from ups.core.testing import run_ranks
from ups.core.watchdog import DONE, FORWARD, FORWARD_DONE, Mark, Watchdog, verdict


def test_a_rank_behind_the_others_is_named_with_where_it_is() -> None:
    message = verdict([(3, FORWARD_DONE), (3, FORWARD), (3, FORWARD_DONE)], 10)
    assert message == (
        "rank 1 stopped answering: no progress for 10 s (distributed.timeout_s); rank 1 is in "
        "the forward pass of step 3, while rank 0, 2 waited after the forward pass of step 3"
    )


def test_a_rank_that_posted_nothing_is_named_as_gone() -> None:
    message = verdict([(7, DONE), None], 5)
    assert message is not None
    assert message.startswith("rank 1 stopped answering")
    assert "rank 1 did not answer (its process or host is gone)" in message


def test_ranks_at_the_same_mark_are_slow_not_silent() -> None:
    assert verdict([(4, FORWARD), (4, FORWARD)], 5) is None


def test_the_process_group_times_out_a_grace_after_the_watchdog() -> None:
    assert collective_timeout(10) == 20
    assert collective_timeout(300) == 360


def exchange(ctx: RunContext, marks: list[Mark]) -> list[Mark | None]:
    """Rank r posts ``marks[r]`` (none when it is missing) and reads every rank's."""
    watchdog = Watchdog(attrs.evolve(ctx, timeout_s=2.0), key="test")
    if ctx.rank >= len(marks):
        return []
    watchdog.mark(*marks[ctx.rank])
    return watchdog.exchange(watchdog.store())


def test_every_rank_reads_every_ranks_mark_from_the_store() -> None:
    marks = [(5, FORWARD_DONE), (5, FORWARD)]
    assert run_ranks(exchange, 2, marks) == [marks, marks]


def test_a_rank_that_never_posts_reads_as_none_after_the_answer_time() -> None:
    assert run_ranks(exchange, 2, [(2, DONE)])[0] == [(2, DONE), None]
