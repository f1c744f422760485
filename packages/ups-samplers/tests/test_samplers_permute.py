"""The keyed permutation behind ``multitask``: any of its positions, without the rest."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ups.samplers._permute import CHUNK, shuffled

profile = settings(settings.get_profile("ups-samplers"), max_examples=60)

sizes = st.one_of(st.integers(1, 70), st.integers(1, 5000))
seeds = st.tuples(st.integers(0, 2**40), st.integers(0, 100))
salts = st.integers(0, 2**40)


@profile
@given(sizes, seeds, salts)
def test_it_is_a_permutation_of_the_size(size: int, seed: tuple[int, int], salt: int) -> None:
    drawn = shuffled(torch.arange(size), size, seed, salt)
    assert drawn.dtype == torch.int64
    assert sorted(drawn.tolist()) == list(range(size))


@profile
@given(sizes, seeds, salts, st.data())
def test_any_positions_give_what_the_whole_permutation_has_there(
    size: int, seed: tuple[int, int], salt: int, data: st.DataObject
) -> None:
    where = data.draw(st.lists(st.integers(0, size - 1), max_size=50))
    whole = shuffled(torch.arange(size), size, seed, salt)
    assert shuffled(torch.tensor(where, dtype=torch.int64), size, seed, salt).tolist() == [
        whole[p].item() for p in where
    ]


def test_positions_across_chunks_and_salts_each_use_their_own_permutation() -> None:
    size, n = 1000, 2 * CHUNK + 17
    where = torch.arange(n) % size
    salt = torch.arange(n) // 700  # several salts a chunk, and chunks of one salt
    drawn = shuffled(where, size, (3, 4), salt)
    for s in salt.unique().tolist():
        mine = salt == s
        assert drawn[mine].tolist() == shuffled(where[mine], size, (3, 4), s).tolist()


def test_another_salt_or_seed_is_another_permutation() -> None:
    base = shuffled(torch.arange(100), 100, (1, 2), 0).tolist()
    assert shuffled(torch.arange(100), 100, (1, 2), 1).tolist() != base
    assert shuffled(torch.arange(100), 100, (1, 3), 0).tolist() != base
    assert shuffled(torch.arange(100), 100, (2, 2), 0).tolist() != base


def test_every_value_is_as_likely_at_a_position() -> None:
    """Over 20,000 salts, position 0 of a permutation of 10 holds each value about 2,000
    times (a binomial's standard deviation is 42; the bound is 7 of them)."""
    first = torch.cat([shuffled(torch.tensor([0]), 10, (0, 0), s) for s in range(20_000)])
    counts = torch.bincount(first, minlength=10)
    assert ((counts - 2000).abs() < 300).all(), counts.tolist()


def test_positions_and_values_are_unrelated() -> None:
    """Position and value are uncorrelated, and so are two salts' permutations (|r| of 300
    permutations of 1000 around 1/sqrt(1000) = 0.03)."""
    where = torch.arange(1000, dtype=torch.float64)
    draws = [shuffled(torch.arange(1000), 1000, (0, 0), s).double() for s in range(301)]
    to_position = [torch.corrcoef(torch.stack((where, d)))[0, 1].item() for d in draws]
    between = [torch.corrcoef(torch.stack(pair))[0, 1].item() for pair in itertools.pairwise(draws)]
    for rs in (to_position, between):
        assert abs(sum(rs) / len(rs)) < 0.01
        assert max(abs(r) for r in rs) < 0.15


@pytest.mark.parametrize("size", [-1, 2**62 + 1])
def test_a_size_out_of_range_is_a_value_error_naming_it(size: int) -> None:
    with pytest.raises(ValueError, match=f"size: {size} is not allowed"):
        shuffled(torch.arange(1), size, (0,), 0)


def test_no_positions_of_an_empty_range_are_nothing() -> None:
    assert shuffled(torch.arange(0), 0, (0,), 0).tolist() == []
