"""The step watchdog's verdict, and its exchange of marks over a real 2-rank job's store."""

from __future__ import annotations

import os
import sys

import attrs

from ups.core import RunContext
from ups.core.dist._context import collective_timeout
from ups.core.dist._watchdog import (
    BACKWARD,
    DONE,
    FORWARD,
    FORWARD_DONE,
    Mark,
    Post,
    Watchdog,
    verdict,
    waiting_in,
)
from ups.core.testing import run_ranks

C10D = os.path.join("site-packages", "torch", "distributed", "distributed_c10d.py")


def test_a_rank_behind_the_others_is_named_with_where_it_is() -> None:
    message = verdict([Post((3, FORWARD_DONE)), Post((3, FORWARD)), Post((3, FORWARD_DONE))], 10)
    assert message == (
        "rank 1 stopped answering: no progress for 10 s (distributed.timeout_s); rank 1 is in "
        "the forward pass of step 3, while rank 0, 2 waited after the forward pass of step 3"
    )


def test_a_rank_that_posted_nothing_is_named_as_gone() -> None:
    message = verdict([Post((7, DONE)), None], 5)
    assert message is not None
    assert message.startswith("rank 1 stopped answering")
    assert "rank 1 did not answer (its process or host is gone)" in message


def test_ranks_at_the_same_mark_are_slow_not_silent() -> None:
    assert verdict([Post((4, FORWARD)), Post((4, FORWARD))], 5) is None
    # one rank works (a slow save) while the other waits for it in a barrier: slow
    assert verdict([Post((4, DONE)), Post((4, DONE), "barrier")], 5) is None
    assert verdict([Post((4, DONE), "barrier"), Post((4, DONE), "barrier")], 5) is None


def test_a_rank_waiting_in_a_collective_the_others_never_entered_is_named() -> None:
    stuck = Post((5, FORWARD_DONE), "barrier", "metrics.factory")
    assert verdict([stuck, Post((5, BACKWARD))], 3) == (
        "rank 0 waits in a collective (barrier) that rank 1 never entered: no progress for 3 s "
        "(distributed.timeout_s); rank 0 is after the forward pass of step 5, in user code "
        "called from metrics.factory, in barrier, while rank 1 waited in the backward pass of "
        "step 5"
    )
    mismatched = verdict([Post((2, DONE), "barrier"), Post((2, DONE), "all_reduce")], 3)
    assert mismatched == (
        "the ranks wait in different collectives: no progress for 3 s (distributed.timeout_s); "
        "rank 0 is at the end of step 2, in barrier; rank 1 is at the end of step 2, in all_reduce"
    )


def test_a_post_travels_as_text() -> None:
    for post in (Post((3, BACKWARD)), Post((1, FORWARD_DONE), "all_gather", "metrics.factory")):
        assert Post.decode(post.encode()) == post


def test_the_collective_a_stack_is_in_is_the_outermost_public_c10d_function() -> None:
    assert waiting_in(sys._getframe()) is None
    code = compile("def barrier():\n    return _inner()\n", C10D, "exec")
    namespace = {"_inner": sys._getframe}
    exec(code, namespace)
    assert waiting_in(namespace["barrier"]()) == "barrier"


def test_the_process_group_times_out_a_grace_after_the_watchdog() -> None:
    assert collective_timeout(10) == 20
    assert collective_timeout(300) == 360


def exchange(ctx: RunContext, marks: list[Mark]) -> list[Post | None]:
    """Rank r posts ``marks[r]`` (none when it is missing) and reads every rank's."""
    watchdog = Watchdog(attrs.evolve(ctx, timeout_s=2.0), key="test")
    if ctx.rank >= len(marks):
        return []
    watchdog.mark(*marks[ctx.rank])
    return watchdog.exchange(watchdog.store())


def test_every_rank_reads_every_ranks_mark_from_the_store() -> None:
    marks = [(5, FORWARD_DONE), (5, FORWARD)]
    posts = [Post(mark) for mark in marks]
    assert run_ranks(exchange, 2, marks) == [posts, posts]


def test_a_rank_that_never_posts_reads_as_none_after_the_answer_time() -> None:
    assert run_ranks(exchange, 2, [(2, DONE)])[0] == [Post((2, DONE)), None]
