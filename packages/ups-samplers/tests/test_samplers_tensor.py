"""The ``tensor`` sampler against torch's ``DistributedSampler`` and its own contract."""

from __future__ import annotations

import itertools
from collections.abc import Sized
from typing import cast

import pytest
import torch
from hypothesis import given, settings
from samplers_strategies import Case, cases, chunk_sizes
from torch.utils.data import Dataset, DistributedSampler

from ups.samplers import TensorDistributedSampler
from ups.samplers._tensor import Permutation

profile = settings(settings.get_profile("ups-samplers"))


def dataset(size: int) -> Dataset[int]:
    """``range(size)`` as a dataset: torch's sampler only asks for its length, too."""
    return cast("Dataset[int]", range(size))


def ours(
    case: Case, rank: int, chunk_size: int = 8192, permutation: Permutation = "torch"
) -> TensorDistributedSampler:
    sampler = TensorDistributedSampler(
        range(case.size),
        num_replicas=case.world_size,
        rank=rank,
        shuffle=case.shuffle,
        seed=case.seed,
        drop_last=case.drop_last,
        chunk_size=chunk_size,
        permutation=permutation,
    )
    sampler.set_epoch(case.epoch)
    return sampler


def torchs(case: Case, rank: int) -> DistributedSampler[int]:
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset(case.size),
        num_replicas=case.world_size,
        rank=rank,
        shuffle=case.shuffle,
        seed=case.seed,
        drop_last=case.drop_last,
    )
    sampler.set_epoch(case.epoch)
    return sampler


@profile
@given(cases(), chunk_sizes)
def test_yields_the_same_indices_as_torchs_sampler(case: Case, chunk_size: int) -> None:
    for rank in range(case.world_size):
        expected = torchs(case, rank)
        sampler = ours(case, rank, chunk_size)
        assert list(sampler) == list(expected)
        assert len(sampler) == len(expected)
        assert (sampler.num_samples, sampler.total_size) == (
            expected.num_samples,
            expected.total_size,
        )


both = pytest.mark.parametrize("permutation", ["torch", "keyed"])


@both
@profile
@given(cases())
def test_every_rank_has_len_indices(permutation: Permutation, case: Case) -> None:
    lengths = {
        len(list(ours(case, rank, permutation=permutation))) for rank in range(case.world_size)
    }
    assert lengths == {len(ours(case, 0))}
    if case.drop_last:
        assert len(ours(case, 0)) == case.size // case.world_size
    else:
        assert len(ours(case, 0)) == -(-case.size // case.world_size)


@both
@profile
@given(cases())
def test_ranks_partition_the_padded_index_list(permutation: Permutation, case: Case) -> None:
    shares = [list(ours(case, rank, permutation=permutation)) for rank in range(case.world_size)]
    # Interleave the shares back into the epoch's index list: rank r holds positions r, r+R, ...
    merged = [i for row in itertools.zip_longest(*shares) for i in row if i is not None]
    assert len(merged) == case.world_size * len(shares[0])
    head, padding = merged[: case.size], merged[case.size :]
    assert len(set(head)) == len(head)
    assert set(head) <= set(range(case.size))
    if case.drop_last:
        assert padding == []
    else:
        assert sorted(head) == list(range(case.size))
        # Padding wraps around: it repeats the list from its start.
        assert padding == (head * (len(padding) // max(1, case.size) + 1))[: len(padding)]
        assert len(padding) < case.world_size


@profile
@given(cases(max_size=300))
def test_set_epoch_reshuffles_deterministically(case: Case) -> None:
    first = list(ours(case, 0))
    assert list(ours(case, 0)) == first
    sampler = ours(case, 0)
    sampler.set_epoch(case.epoch + 1)
    if not case.shuffle:
        assert list(sampler) == first


@both
def test_another_epoch_gives_another_order(permutation: Permutation) -> None:
    sampler = TensorDistributedSampler(
        range(100), num_replicas=2, rank=1, seed=3, permutation=permutation
    )
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second
    assert sorted(first) != sorted(second)  # the ranks' shares change too, not just their order


def test_indices_are_int32_tensors_and_a_view_without_padding() -> None:
    sampler = TensorDistributedSampler(range(1000), num_replicas=4, rank=2, seed=1)
    indices = sampler.indices()
    assert indices.dtype == torch.int32
    assert indices.stride() == (4,)  # a strided slice of the permutation, not a copy
    assert all(type(i) is int for i in sampler)


class Huge(Sized):
    """A dataset too big for int32 indices (its items are never read)."""

    def __len__(self) -> int:
        return 2**31 + 5


def test_indices_are_int64_when_the_dataset_is_too_big_for_int32() -> None:
    world_size = 2**21
    sampler = TensorDistributedSampler(
        Huge(), num_replicas=world_size, rank=world_size - 1, shuffle=False
    )
    indices = sampler.indices()
    assert indices.dtype == torch.int64
    assert len(indices) == len(sampler) == 1025
    # The last rank's last index is padding: it wrapped around to the start.
    assert indices[-2].item() == world_size - 1 + 1023 * world_size
    assert indices[-1].item() == (world_size - 1 + 1024 * world_size) - len(Huge())


def test_the_epoch_is_fixed_when_iteration_starts_as_in_torch() -> None:
    sampler = TensorDistributedSampler(range(50), num_replicas=3, rank=0, seed=9)
    expected: DistributedSampler[int] = DistributedSampler(
        dataset(50), num_replicas=3, rank=0, seed=9
    )
    started, started_torch = iter(sampler), iter(expected)
    sampler.set_epoch(4)
    expected.set_epoch(4)
    assert list(started) == list(started_torch)
    assert list(sampler) == list(expected)


@pytest.mark.parametrize(("num_replicas", "rank"), [(2, 2), (2, -1), (0, 0)])
def test_rejects_a_rank_outside_the_world(num_replicas: int, rank: int) -> None:
    with pytest.raises(ValueError, match="rank|num_replicas"):
        TensorDistributedSampler(range(10), num_replicas=num_replicas, rank=rank)


def test_rejects_an_empty_chunk() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        TensorDistributedSampler(range(10), num_replicas=1, rank=0, chunk_size=0)


def test_a_large_dataset_gives_the_same_indices_as_torchs_sampler() -> None:
    # torch draws the permutation as int64, this sampler as int32: they must agree.
    case = Case(size=300_001, world_size=3, seed=123, epoch=2, shuffle=True, drop_last=False)
    for rank in range(case.world_size):
        assert list(ours(case, rank)) == list(torchs(case, rank))


# -- permutation="keyed" --------------------------------------------------------------------


@profile
@given(cases(max_size=300))
def test_keyed_is_deterministic_and_without_shuffle_is_torchs_order(case: Case) -> None:
    for rank in range(case.world_size):
        keyed = list(ours(case, rank, permutation="keyed"))
        assert list(ours(case, rank, permutation="keyed")) == keyed
        if not case.shuffle:
            assert keyed == list(torchs(case, rank))


def test_keyed_is_another_order_than_torchs_and_another_per_seed() -> None:
    def share(seed: int, permutation: Permutation) -> list[int]:
        return list(TensorDistributedSampler(range(100), 2, 0, seed=seed, permutation=permutation))

    assert share(0, "keyed") != share(0, "torch")
    assert share(0, "keyed") != share(1, "keyed")


def test_keyed_indices_are_int32() -> None:
    sampler = TensorDistributedSampler(range(1000), 4, 2, permutation="keyed")
    assert sampler.indices().dtype == torch.int32


def test_another_permutation_is_a_value_error_naming_it() -> None:
    with pytest.raises(
        ValueError, match="^permutation: must be one of 'torch', 'keyed', not 'fast'$"
    ):
        TensorDistributedSampler(range(10), 2, 0, permutation="fast")  # type: ignore[arg-type]
