"""The ``exact`` sampler: every index on exactly one rank, none padded."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from samplers_strategies import Case, Setup, cases, chunk_sizes

from ups.samplers import ExactDistributedSampler

profile = settings(settings.get_profile("ups-samplers"), max_examples=40)


def exact(case: Case, rank: int, chunk_size: int = 8192) -> ExactDistributedSampler:
    sampler = Setup("exact", case).build(case.world_size, rank, chunk_size)
    assert isinstance(sampler, ExactDistributedSampler)
    return sampler


def draw(case: Case, epoch: int | None = None) -> list[list[int]]:
    """Every rank's indices for the case's epoch (or ``epoch``)."""
    shares = []
    for rank in range(case.world_size):
        sampler = exact(case, rank)
        if epoch is not None:
            sampler.set_epoch(epoch)
        shares.append(list(sampler))
    return shares


def merged(shares: list[list[int]]) -> list[int]:
    """The epoch's order: rank r holds its positions r, r + world_size, ..."""
    return [i for row in itertools.zip_longest(*shares) for i in row if i is not None]


@profile
@given(cases(max_size=500), chunk_sizes)
def test_every_index_goes_to_exactly_one_rank(case: Case, chunk_size: int) -> None:
    shares = [list(exact(case, rank, chunk_size)) for rank in range(case.world_size)]
    assert sorted(i for share in shares for i in share) == list(range(case.size))
    order = merged(shares)
    assert sorted(order) == list(range(case.size))
    if not case.shuffle:
        assert order == list(range(case.size))


@profile
@given(cases(max_size=500))
def test_lengths_differ_by_one_at_most_and_len_says_them(case: Case) -> None:
    shares = draw(case)
    lengths = [len(share) for share in shares]
    assert lengths == [len(exact(case, rank)) for rank in range(case.world_size)]
    assert lengths == [len(range(rank, case.size, case.world_size)) for rank in range(len(lengths))]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # the first ranks take the extra ones


@profile
@given(cases(max_size=500))
def test_the_order_is_decided_by_seed_and_epoch(case: Case) -> None:
    first = draw(case)
    assert draw(case) == first
    again = draw(case, case.epoch + 1)
    if not case.shuffle:
        assert again == first
    elif case.size >= 10:
        assert merged(again) != merged(first)
        assert sorted(merged(again)) == sorted(merged(first))


def test_another_seed_gives_another_order() -> None:
    one = ExactDistributedSampler(range(50), num_replicas=2, rank=0, shuffle=True, seed=1)
    two = ExactDistributedSampler(range(50), num_replicas=2, rank=0, shuffle=True, seed=2)
    assert list(one) != list(two)


def test_not_shuffled_by_default() -> None:
    sampler = ExactDistributedSampler(range(11), num_replicas=3, rank=1)
    sampler.set_epoch(3)
    assert list(sampler) == [1, 4, 7, 10]
    assert len(sampler) == 4


def test_more_ranks_than_samples_leaves_some_empty() -> None:
    shares = [list(ExactDistributedSampler(range(3), num_replicas=5, rank=r)) for r in range(5)]
    assert shares == [[0], [1], [2], [], []]


@pytest.mark.parametrize(("num_replicas", "rank"), [(2, 2), (3, -1), (0, 0)])
def test_rejects_a_rank_outside_the_world(num_replicas: int, rank: int) -> None:
    with pytest.raises(ValueError, match=rf"^rank: .*, not {rank}$|^num_replicas: .*, not 0$"):
        ExactDistributedSampler(range(10), num_replicas=num_replicas, rank=rank)
