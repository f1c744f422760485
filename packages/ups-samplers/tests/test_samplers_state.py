"""Resuming the three samplers mid-epoch from ``state_dict()``: on as many ranks, on another
number of ranks, several times over, through ``torch.save``; and states that must not load."""

from __future__ import annotations

import io
import itertools
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from samplers_strategies import Setup, chunk_sizes, setups, world_sizes

from ups.samplers import (
    ExactDistributedSampler,
    MultiTaskDistributedSampler,
    TensorDistributedSampler,
)

profile = settings(settings.get_profile("ups-samplers"), max_examples=40)

Sampler = TensorDistributedSampler | MultiTaskDistributedSampler | ExactDistributedSampler


def ranks(setup: Setup, world: int, state: dict[str, Any] | None, chunk: int) -> list[Sampler]:
    """The samplers of every rank of ``world``, resumed from ``state`` when one is given;
    ``len()`` checked against the world's rule (one length, or lengths one apart)."""
    samplers = [setup.build(world, rank, chunk) for rank in range(world)]
    if state is not None:
        for sampler in samplers:
            sampler.load_state_dict(state)
    lengths = [len(sampler) for sampler in samplers]
    if setup.pads:
        assert len(set(lengths)) == 1
    else:
        assert max(lengths) - min(lengths) <= 1
    return samplers


def take(samplers: list[Sampler], k: int | None = None) -> tuple[list[list[int]], dict[str, Any]]:
    """Take ``k`` indices (all when None) on every rank, checking that ``len()`` said how many
    there were; return what each took and the state after, the same on every rank that took
    as many."""
    taken, states = [], []
    for sampler in samplers:
        length = len(sampler)
        iterator = iter(sampler)
        taken.append(list(itertools.islice(iterator, k)))
        states.append(sampler.state_dict())
        if k is None:
            assert len(taken[-1]) == length
        else:
            assert len(taken[-1]) == k
            assert len(taken[-1]) + len(list(iterator)) == length
    if k is not None or len({len(share) for share in taken}) == 1:
        assert all(state == states[0] for state in states)
    return taken, states[0]  # rank 0 took the most: at the end, its state is the end


def epoch_multiset(setup: Setup) -> Counter[int]:
    """The samples of the epoch on the setup's world, padding left out."""
    case = setup.case
    if setup.kind == "exact" or (setup.kind in ("tensor", "keyed") and not setup.drop_last):
        return Counter(range(getattr(case, "size", 0)))
    world = setup.world_size
    if setup.kind == "multitask":  # its epoch on one process, which drops nothing
        return Counter(i for sampler in ranks(setup, 1, None, 8192) for i in sampler)
    # drop_last: the epoch as drawn.
    return Counter(i for sampler in ranks(setup, world, None, 8192) for i in sampler)


def assert_covers(setup: Setup, seen: Counter[int], worlds: list[int]) -> None:
    """What the ranks of ``worlds`` (the first, then each resumed on) took is the epoch: each
    sample exactly once for the exact sampler; else at least once, more only by padding
    (fewer than each world's size a world), or, with drop_last, fewer lost than that."""
    epoch = epoch_multiset(setup)
    if setup.kind == "exact":
        assert seen == epoch
    elif setup.drop_last:  # a multitask epoch's tail is dropped by the world that ends it
        assert not seen - epoch
        dropping = worlds if setup.kind == "multitask" else worlds[1:]
        assert (epoch - seen).total() <= sum(world - 1 for world in dropping)
    else:
        assert not epoch - seen
        padded = worlds
        assert (seen - epoch).total() <= sum(world - 1 for world in padded)


def shortest(samplers: list[Sampler]) -> int:
    return min(len(sampler) for sampler in samplers)


def flat(shares: list[list[int]]) -> Counter[int]:
    return Counter(i for share in shares for i in share)


# -- on as many ranks -----------------------------------------------------------------------


@profile
@given(setups(), chunk_sizes, st.data())
def test_on_as_many_ranks_the_state_continues_every_rank_where_it_stopped(
    setup: Setup, chunk: int, data: st.DataObject
) -> None:
    world = setup.world_size
    full, _ = take(ranks(setup, world, None, chunk))
    samplers = ranks(setup, world, None, chunk)
    k = data.draw(st.integers(0, shortest(samplers)), label="k")
    taken, state = take(samplers, k)
    block = getattr(setup.case, "batch_size", 1) if setup.kind == "multitask" else 1
    assert state["segments"] == [[world, k, block]]
    assert state["epoch"] == setup.case.epoch
    resumed = ranks(setup, world, None, chunk)
    for sampler in resumed:
        sampler.set_epoch(setup.case.epoch + 3)  # the state's epoch wins
        sampler.load_state_dict(state)
        assert sampler.epoch == setup.case.epoch
    rest, _ = take(resumed)
    assert [a + b for a, b in zip(taken, rest, strict=True)] == full


# -- on another number of ranks -------------------------------------------------------------


@profile
@given(setups(), world_sizes, chunk_sizes, st.data())
def test_on_another_world_size_the_rest_of_the_epoch_is_dealt_anew(
    setup: Setup, new_world: int, chunk: int, data: st.DataObject
) -> None:
    samplers = ranks(setup, setup.world_size, None, chunk)
    k = data.draw(st.integers(0, shortest(samplers)), label="k")
    taken, state = take(samplers, k)
    rest, _ = take(ranks(setup, new_world, state, chunk))
    assert_covers(setup, flat(taken) + flat(rest), [setup.world_size, new_world])


@profile
@given(setups(), world_sizes, world_sizes, chunk_sizes, st.data())
def test_resuming_twice_on_other_world_sizes_still_covers_the_epoch(
    setup: Setup, second: int, third: int, chunk: int, data: st.DataObject
) -> None:
    seen: Counter[int] = Counter()
    state = None
    for world in (setup.world_size, second):
        samplers = ranks(setup, world, state, chunk)
        k = data.draw(st.integers(0, shortest(samplers)), label=f"k on {world}")
        taken, state = take(samplers, k)
        seen += flat(taken)
    rest, end = take(ranks(setup, third, state, chunk))
    assert_covers(setup, seen + flat(rest), [setup.world_size, second, third])
    # A state saved at the end of the epoch resumes to nothing.
    assert all(len(sampler) == 0 for sampler in ranks(setup, third, end, chunk))
    assert all(len(sampler) == 0 for sampler in ranks(setup, second, end, chunk))


@profile
@given(setups(), world_sizes, chunk_sizes, st.data())
def test_a_resumed_state_resumes_exactly_on_its_own_world(
    setup: Setup, new_world: int, chunk: int, data: st.DataObject
) -> None:
    """Saved on the new world after resuming there, a state continues each rank exactly."""
    samplers = ranks(setup, setup.world_size, None, chunk)
    _, state = take(samplers, data.draw(st.integers(0, shortest(samplers)), label="k"))
    full, _ = take(ranks(setup, new_world, state, chunk))
    samplers = ranks(setup, new_world, state, chunk)
    k = data.draw(st.integers(0, shortest(samplers)), label="k2")
    taken, again = take(samplers, k)
    rest, _ = take(ranks(setup, new_world, again, chunk))
    assert [a + b for a, b in zip(taken, rest, strict=True)] == full


def test_the_exact_sampler_deals_the_rest_in_order() -> None:
    setup = [ExactDistributedSampler(range(10), num_replicas=2, rank=r) for r in range(2)]
    taken, state = take(list(setup), 2)
    assert taken == [[0, 2], [1, 3]]
    resumed = [ExactDistributedSampler(range(10), num_replicas=3, rank=r) for r in range(3)]
    for sampler in resumed:
        sampler.load_state_dict(state)
    assert [list(sampler) for sampler in resumed] == [[4, 7], [5, 8], [6, 9]]


# -- the state as a value -------------------------------------------------------------------


@profile
@given(setups(), world_sizes, st.data())
def test_a_state_survives_torch_save_and_a_weights_only_load(
    setup: Setup, new_world: int, data: st.DataObject
) -> None:
    samplers = ranks(setup, setup.world_size, None, 8192)
    _, state = take(samplers, data.draw(st.integers(0, shortest(samplers)), label="k"))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded == state
    assert (
        take(ranks(setup, new_world, loaded, 8192))[0]
        == take(ranks(setup, new_world, state, 8192))[0]
    )


@profile
@given(setups(), world_sizes, st.data())
def test_set_epoch_drops_a_state_of_another_epoch_and_keeps_one_of_its_own(
    setup: Setup, new_world: int, data: st.DataObject
) -> None:
    samplers = ranks(setup, setup.world_size, None, 8192)
    _, state = take(samplers, data.draw(st.integers(0, shortest(samplers)), label="k"))
    expected, _ = take(ranks(setup, new_world, state, 8192))
    kept = ranks(setup, new_world, state, 8192)
    for sampler in kept:
        sampler.set_epoch(setup.case.epoch)
    assert take(kept)[0] == expected
    dropped = ranks(setup, new_world, state, 8192)
    fresh = ranks(setup, new_world, None, 8192)
    for sampler in dropped + fresh:
        sampler.set_epoch(setup.case.epoch + 1)
    assert [len(sampler) for sampler in dropped] == [len(sampler) for sampler in fresh]
    assert take(dropped)[0] == take(fresh)[0]


def test_a_fresh_sampler_has_an_empty_state() -> None:
    sampler = TensorDistributedSampler(range(10), num_replicas=2, rank=0, seed=3)
    sampler.set_epoch(4)
    assert sampler.state_dict() == {
        "sampler": "TensorDistributedSampler",
        "seed": 3,
        "size": 10,
        "shuffle": True,
        "drop_last": False,
        "permutation": "torch",
        "epoch": 4,
        "segments": [],
    }


# -- states that must not load --------------------------------------------------------------


def state_of(sampler: Sampler, k: int = 1) -> dict[str, Any]:
    iterator = iter(sampler)
    next(itertools.islice(iterator, k - 1, None))
    return sampler.state_dict()


@pytest.mark.parametrize(
    ("saved", "loading", "match"),
    [
        (
            TensorDistributedSampler(range(10), 2, 0, seed=1),
            TensorDistributedSampler(range(10), 2, 0, seed=2),
            r"seed is 1, this sampler's is 2",
        ),
        (
            TensorDistributedSampler(range(10), 2, 0),
            TensorDistributedSampler(range(11), 2, 0),
            r"size is 10, this sampler's is 11",
        ),
        (
            TensorDistributedSampler(range(10), 2, 0),
            TensorDistributedSampler(range(10), 2, 0, shuffle=False),
            r"shuffle is True, this sampler's is False",
        ),
        (
            TensorDistributedSampler(range(10), 2, 0),
            TensorDistributedSampler(range(10), 2, 0, drop_last=True),
            r"drop_last is False, this sampler's is True",
        ),
        (
            TensorDistributedSampler(range(10), 2, 0),
            ExactDistributedSampler(range(10), 2, 0),
            r"sampler is 'TensorDistributedSampler', this sampler's is 'ExactDistributedSampler'",
        ),
        (
            ExactDistributedSampler(range(10), 2, 0, seed=5),
            ExactDistributedSampler(range(10), 2, 0, seed=6),
            r"seed is 5, this sampler's is 6",
        ),
        (
            ExactDistributedSampler(range(10), 2, 0),
            ExactDistributedSampler(range(9), 2, 0),
            r"size is 10, this sampler's is 9",
        ),
        (
            MultiTaskDistributedSampler([3, 4], 2, 0),
            MultiTaskDistributedSampler([3, 5], 2, 0),
            r"sizes is \[3, 4\], this sampler's is \[3, 5\]",
        ),
        (
            MultiTaskDistributedSampler([3, 4], 2, 0),
            MultiTaskDistributedSampler([3, 4], 2, 0, mixing="balanced"),
            r"shares is \[0\.42857\d*, 0\.57142\d*\], this sampler's is \[0\.5, 0\.5\]",
        ),
        (
            MultiTaskDistributedSampler([3, 4], 2, 0),
            MultiTaskDistributedSampler([3, 4], 2, 0, epoch_size=20),
            r"length is 7, this sampler's is 20",
        ),
        (
            MultiTaskDistributedSampler([3, 4], 2, 0, seed=1),
            MultiTaskDistributedSampler([3, 4], 2, 0, seed=0),
            r"seed is 1, this sampler's is 0",
        ),
        (
            MultiTaskDistributedSampler([3, 4], 2, 0),
            TensorDistributedSampler(range(7), 2, 0),
            r"sampler is 'MultiTaskDistributedSampler'",
        ),
    ],
)
def test_a_state_of_another_sampler_is_a_value_error_naming_the_value(
    saved: Sampler, loading: Sampler, match: str
) -> None:
    state = state_of(saved)
    with pytest.raises(ValueError, match=match):
        loading.load_state_dict(state)
    # A refused state leaves the sampler as it was: at the start of its epoch.
    assert loading.state_dict()["segments"] == []
    assert len(list(loading)) == len(loading)


@pytest.mark.parametrize("segment", [[0, 1], [2, -1]])
def test_a_state_with_a_bad_segment_is_a_value_error(segment: list[int]) -> None:
    sampler = TensorDistributedSampler(range(10), num_replicas=2, rank=0)
    state = {**sampler.state_dict(), "segments": [segment]}
    with pytest.raises(ValueError, match=rf"bad segment \[{segment[0]}, {segment[1]}\]"):
        sampler.load_state_dict(state)
