"""The ``multitask`` sampler: the mix of tasks, one global stream dealt to the ranks so that W
ranks of batch b take what one process of batch W·b takes, the balance of every global batch,
the order, bad input."""

from __future__ import annotations

import collections
import itertools
import math
from collections import Counter
from collections.abc import Iterable
from typing import Any, cast

import attrs
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from samplers_strategies import TaskCase, multitask, task_cases
from torch.utils.data import ConcatDataset, Dataset, TensorDataset

from ups.samplers import MultiTaskDistributedSampler, WithTaskIds

profile = settings(settings.get_profile("ups-samplers"), max_examples=40)


def draw(case: TaskCase, epoch: int | None = None) -> list[list[int]]:
    """Every rank's indices for the case's epoch (or ``epoch``)."""
    shares = []
    for rank in range(case.world_size):
        sampler = multitask(case, rank)
        if epoch is not None:
            sampler.set_epoch(epoch)
        shares.append(list(sampler))
    return shares


def rounded_length(case: TaskCase, length: int, world: int | None = None) -> int:
    """``length`` rounded to a multiple of the world: down with ``drop_last`` (not with
    ``max``), else up."""
    world = world or case.world_size
    if case.drop_last and case.epoch_size != "max":
        return length // world * world
    return -(-length // world) * world


def global_batches(case: TaskCase, world: int, batch: int) -> list[Counter[int]]:
    """The global batches of the case's epoch on ``world`` ranks of ``batch``: batch ``t`` of
    every rank together, as a multiset, for the batches no padding reaches."""
    case = attrs.evolve(case, world_size=world, batch_size=batch)
    shares = draw(case)
    whole = multitask(case, 0).length // (world * batch)
    return [
        Counter(i for share in shares for i in share[t * batch : (t + 1) * batch])
        for t in range(whole)
    ]


def expected_shares(case: TaskCase) -> list[float]:
    """Each task's share of an epoch, from the mixing's definition."""
    if case.mixing == "balanced":
        raw = [1.0] * len(case.sizes)
    elif case.mixing == "proportional":
        raw = [float(size) for size in case.sizes]
    elif case.mixing == "temperature":
        raw = [size ** (1 / case.temperature) for size in case.sizes]
    else:
        assert case.weights is not None
        raw = list(case.weights)
    return [w / sum(raw) for w in raw]


def window_errors(labels: list[int], num_tasks: int, m: int) -> list[float]:
    """Per task, the largest ``|count in a window of m - m * count / len|`` over every window
    of ``m`` consecutive labels."""
    n = len(labels)
    one_hot = torch.nn.functional.one_hot(torch.tensor(labels), num_tasks).to(torch.float64)
    prefix = torch.cat((torch.zeros(1, num_tasks, dtype=torch.float64), one_hot.cumsum(0)))
    in_window = prefix[m:] - prefix[:-m]
    expected = m * prefix[-1] / n
    return (in_window - expected).abs().max(0).values.tolist()


# -- lengths and counts ---------------------------------------------------------------------


@profile
@given(task_cases())
def test_every_rank_yields_len_indices_all_the_same_number(case: TaskCase) -> None:
    shares = draw(case)
    length = len(multitask(case, 0))
    assert [len(share) for share in shares] == [length] * case.world_size
    assert [len(multitask(case, rank)) for rank in range(case.world_size)] == [length] * len(shares)
    epoch = multitask(case, 0).length
    assert length * case.world_size == rounded_length(case, epoch)


@profile
@given(task_cases())
def test_the_counts_follow_the_shares_whatever_the_world(case: TaskCase) -> None:
    sampler = multitask(case, 0)
    shares = expected_shares(case)
    assert sampler.shares == pytest.approx(shares)
    length = sampler.length
    if case.epoch_size == "sum":
        assert length == sum(case.sizes)
    elif case.epoch_size == "max":
        # The shortest epoch at least the basic one in which every task with a share fits.
        counts = sampler.counts()
        assert all(c >= n for c, n, p in zip(counts, case.sizes, shares, strict=True) if p)
    else:
        assert length == case.epoch_size
    counts = sampler.counts()
    assert sum(counts) == length
    for count, share in zip(counts, shares, strict=True):
        assert abs(count - length * share) <= 1 + 1e-9
        if share == 0:
            assert count == 0
    assert multitask(case, 0, num_replicas=1).counts() == counts  # no world in it
    # The counts are those of the epoch drawn on one process.
    alone = Counter(case.task_of(i) for i in multitask(case, 0, num_replicas=1))
    assert [alone[t] for t in range(len(case.sizes))] == counts
    assert -1 not in alone


# -- what each task contributes -------------------------------------------------------------


@profile
@given(task_cases(), st.integers(1, 3))
def test_epochs_run_through_passes_over_each_task_without_repeats(
    case: TaskCase, epochs: int
) -> None:
    """Epochs 0 .. epochs-1 on one process read a task's stream of passes from its start, an
    epoch the task's count: every sample of the task as often as every other, give or take
    one, and only samples of the task."""
    case = attrs.evolve(case, world_size=1)
    counts = multitask(case, 0).counts()
    seen: Counter[int] = Counter()
    for epoch in range(epochs):
        seen.update(i for share in draw(case, epoch) for i in share)
    for task, (start, size) in enumerate(zip(case.offsets, case.sizes, strict=True)):
        times = [seen[i] for i in range(start, start + size)]
        assert sum(times) == epochs * counts[task]
        assert max(times) - min(times) <= 1
    assert all(case.task_of(i) >= 0 for i in seen)


@profile
@given(task_cases())
def test_without_shuffle_an_epoch_takes_the_next_samples_of_each_task_in_order(
    case: TaskCase,
) -> None:
    """Epoch ``e`` reads a task's samples ``e·c .. e·c + c - 1`` of its stream (``c``: the
    task's count), whatever the world; padding repeats fewer samples than the ranks."""
    case = attrs.evolve(case, shuffle=False)
    counts = multitask(case, 0).counts()
    seen = Counter(i for share in draw(case) for i in share)
    expected: Counter[int] = Counter()
    for task, (start, size) in enumerate(zip(case.offsets, case.sizes, strict=True)):
        first = case.epoch * counts[task]
        expected.update(start + (first + k) % size for k in range(counts[task]))
    if rounded_length(case, sum(counts)) >= sum(counts):
        assert not expected - seen
        assert (seen - expected).total() < case.world_size
    else:  # drop_last: the tail is left out
        assert not seen - expected
        assert (expected - seen).total() < case.world_size


@settings(settings.get_profile("ups-samplers"), max_examples=25)
@given(
    st.lists(st.one_of(st.integers(1, 5), st.integers(1, 300)), min_size=1, max_size=4),
    st.integers(1, 8),
    st.integers(1, 8),
    st.integers(0, 2**40),
    st.integers(3, 4),
    st.floats(0, 1),
    st.integers(1, 5),
)
@example([212], 3, 2, 898357, 4, 0.5, 1).via("issue 18: the padding drew from the next pass")
def test_proportional_sum_epochs_are_full_passes_and_resume_anywhere_on_the_rest(
    sizes: list[int], world: int, new_world: int, seed: int, epochs: int, stop: float, batch: int
) -> None:
    """With the defaults (``proportional``, ``sum``), every epoch holds every sample, its
    padding to the world repeating fewer than ``world`` of that epoch's own (as torch's
    ``DistributedSampler`` pads), never drawing ahead: epoch after epoch, each is a pass.
    Stopped part-way (``stop``) through the last epoch and resumed on another world size, the
    rest holds exactly the samples not taken yet, and fewer than ``new_world`` repeats."""
    every = Counter(range(sum(sizes)))

    def ranks(num: int, epoch: int, state: dict[str, Any] | None = None) -> list[Any]:
        samplers = [
            MultiTaskDistributedSampler(sizes, num, r, seed=seed, batch_size=batch)
            for r in range(num)
        ]
        for sampler in samplers:
            sampler.set_epoch(epoch)
            if state is not None:
                sampler.load_state_dict(state)
        return samplers

    for epoch in range(epochs):
        epoch_samples = Counter(i for sampler in ranks(world, epoch) for i in sampler)
        assert not every - epoch_samples  # every sample, in every epoch
        assert (epoch_samples - every).total() == -sum(sizes) % world  # padding, of its own
    first = ranks(world, epochs - 1)
    k = int(stop * len(first[0]))
    taken: Counter[int] = Counter()
    for sampler in first:
        taken.update(itertools.islice(iter(sampler), k))
    rest = Counter(
        i for sampler in ranks(new_world, epochs - 1, first[0].state_dict()) for i in sampler
    )
    left = every - taken  # the epoch's samples, its padding to the first world left out
    assert not left - rest  # every sample not taken yet, as often as it was left
    assert (rest - left).total() < new_world  # and padding only
    assert set(taken) | set(rest) == set(every)


@profile
@given(task_cases(epoch_sizes=st.just("max")))
def test_max_epoch_size_shows_every_task_with_a_share_in_full(case: TaskCase) -> None:
    """Even with drop_last: ``max`` rounds up, not down."""
    case = attrs.evolve(case, epoch=0)
    seen = {i for share in draw(case) for i in share}
    shares = multitask(case, 0).shares
    for start, size, share in zip(case.offsets, case.sizes, shares, strict=True):
        missing = set(range(start, start + size)) - seen
        assert len(missing) == (size if share == 0 else 0)


def test_weights_of_zero_leave_their_tasks_out() -> None:
    sampler = MultiTaskDistributedSampler(
        [10, 20, 30], num_replicas=1, rank=0, mixing="weights", weights=[1, 0, 3]
    )
    assert sampler.counts() == [15, 0, 45]
    assert not any(10 <= i < 30 for i in sampler)


def test_a_concat_dataset_gives_the_tasks() -> None:
    parts = [TensorDataset(torch.zeros(n)) for n in (3, 5, 2)]
    sampler = MultiTaskDistributedSampler(ConcatDataset(parts), num_replicas=2, rank=1)
    assert sampler.sizes == [3, 5, 2]
    assert sampler.offsets == [0, 3, 8]
    assert sampler.task_of(torch.tensor([0, 2, 3, 7, 8, 9])).tolist() == [0, 0, 1, 1, 2, 2]


# -- one global stream ----------------------------------------------------------------------


@profile
@given(task_cases(), st.integers(1, 8), st.integers(1, 6))
def test_w_ranks_of_batch_b_take_the_global_batches_of_one_process_of_batch_w_b(
    case: TaskCase, world: int, batch: int
) -> None:
    """Global batch ``t`` (batch ``t`` of every rank together) on ``world`` ranks of ``batch``
    holds the samples of batch ``t`` on one process of ``world · batch``, and of ``world``
    batches of ``batch`` on one process: for every mixing, epoch size and option."""
    many = global_batches(case, world, batch)
    assert many == global_batches(case, 1, world * batch)
    alone = global_batches(case, 1, batch)
    assert many == [sum(alone[t * world : (t + 1) * world], Counter()) for t in range(len(many))]


@profile
@given(task_cases(), st.integers(1, 8), st.integers(1, 6), st.floats(0, 1), st.data())
def test_resumed_at_a_batch_on_another_world_the_stream_goes_on(
    case: TaskCase, world: int, batch: int, stop: float, data: st.DataObject
) -> None:
    """Stopped after whole batches and resumed on another world and batch size, the ranks go
    on with the global stream where it stopped: what one process takes from there."""
    samplers = [multitask(case, r) for r in range(case.world_size)]
    taken = int(stop * len(samplers[0])) // case.batch_size * case.batch_size
    for sampler in samplers:
        collections.deque(itertools.islice(iter(sampler), taken), maxlen=0)
    state = samplers[0].state_dict()
    position = taken * case.world_size
    assume(position + world * batch <= multitask(case, 0).length)
    moved = attrs.evolve(case, world_size=world, batch_size=batch)
    rest = []
    for rank in range(world):
        sampler = multitask(moved, rank)
        sampler.load_state_dict(state)
        rest.append(list(sampler)[:batch])
    alone = multitask(attrs.evolve(case, world_size=1, batch_size=1), 0)
    stream = list(alone)[position : position + world * batch]
    assert Counter(i for share in rest for i in share) == Counter(stream)


@profile
@given(task_cases())
def test_every_rank_holds_its_share_of_every_task_in_every_global_batch(case: TaskCase) -> None:
    """Within each global batch, each rank holds each task's count in it divided by the
    ranks, within one."""
    shares = draw(case)
    b, world = case.batch_size, case.world_size
    for t in range(multitask(case, 0).length // (world * b)):  # the batches padding leaves be
        batches = [[case.task_of(i) for i in share[t * b : (t + 1) * b]] for share in shares]
        together = Counter(task for batch in batches for task in batch)
        for batch in batches:
            mine = Counter(batch)
            for task, count in together.items():
                assert abs(mine[task] - count / world) < 1, (t, batches)


@profile
@given(task_cases())
def test_the_smallest_task_is_dealt_round_robin_over_the_epoch(case: TaskCase) -> None:
    """The smallest task's samples go to the ranks in turn, so every rank holds its share of
    it over the epoch within one; with two tasks, of both. (The other tasks' remainders in
    each global batch go where the deal puts them: see docs/samplers.md.)"""
    counts = multitask(case, 0).counts()
    smallest = min(range(len(counts)), key=lambda t: (counts[t] or sum(counts), t))
    shares = draw(case)
    whole = multitask(case, 0).length // (case.world_size * case.batch_size) * case.batch_size
    seen = [Counter(case.task_of(i) for i in share[:whole]) for share in shares]
    checked = [smallest] if len(counts) > 2 else range(len(counts))
    for task in checked:
        total = sum(mine[task] for mine in seen)
        assert max(mine[task] for mine in seen) - min(mine[task] for mine in seen) <= 1, task
        assert all(abs(mine[task] - total / case.world_size) < 1 for mine in seen)


@profile
@given(task_cases(), st.integers(1, 8), st.integers(1, 6))
def test_a_sample_has_one_place_whatever_the_world(case: TaskCase, world: int, batch: int) -> None:
    """``places`` keys each sample of the epoch: the same sample at the same place on any
    world and batch size, no two samples at one place (padding repeats its sample's)."""

    def keyed(world: int, batch: int) -> dict[int, int]:
        moved = attrs.evolve(case, world_size=world, batch_size=batch)
        pairs: dict[int, int] = {}
        for rank in range(world):
            sampler = multitask(moved, rank)
            indices = list(sampler)
            for place, index in zip(sampler.places(0, len(indices)).tolist(), indices, strict=True):
                assert pairs.setdefault(place, index) == index
        return pairs

    one = keyed(1, 1)
    assert sorted(one) == list(range(len(one)))
    many = keyed(world, batch)
    assert all(one[place] == index for place, index in many.items())


# -- the mix in the global stream -----------------------------------------------------------


@profile
@given(task_cases())
@example(  # six tasks of one sample, all placed mid-epoch (see test_small_tasks_do_not_...)
    TaskCase(
        sizes=(1, 1, 1, 1, 1, 1, 7),
        world_size=1,
        seed=0,
        epoch=0,
        mixing="proportional",
        temperature=2.0,
        weights=None,
        epoch_size="sum",
        shuffle=False,
        drop_last=False,
    )
)
def test_every_stretch_of_the_stream_holds_the_mix(case: TaskCase) -> None:
    """In every window of m consecutive samples of the global stream (one process, batch 1),
    each task's count is within ``ceil(log2 tasks)`` of m times its share: each even merge of
    the tree is off by half a sample at most, at each end of the window."""
    labels = [case.task_of(i) for i in multitask(attrs.evolve(case, world_size=1, batch_size=1), 0)]
    bound = max(1, math.ceil(math.log2(len(case.sizes))))
    for m in sorted({min(8, len(labels)), len(labels)} - {0}):
        errors = window_errors(labels, len(case.sizes), m)
        assert max(errors) <= bound, (m, errors, labels)


@profile
@given(task_cases(max_tasks=2))
def test_with_two_tasks_every_stretch_holds_the_mix_give_or_take_one(case: TaskCase) -> None:
    """With one or two tasks, every window's count of each is within one of its share."""
    labels = [case.task_of(i) for i in multitask(attrs.evolve(case, world_size=1, batch_size=1), 0)]
    for m in {m for m in (1, 2, 3, 5, 8, len(labels)) if 0 < m <= len(labels)}:
        errors = window_errors(labels, len(case.sizes), m)
        assert max(errors) < 1, (m, errors, labels)


def test_three_balanced_tasks_never_repeat_a_task_in_a_row() -> None:
    sampler = MultiTaskDistributedSampler(
        [5, 50, 500], num_replicas=1, rank=0, mixing="balanced", epoch_size=90
    )
    labels = sampler.task_of(sampler.indices()).tolist()
    assert len(labels) == 90
    assert all(a != b for a, b in itertools.pairwise(labels))


def test_small_tasks_do_not_cluster_in_a_run() -> None:
    """One task of 16 samples, seven of one: 16 of the 23 samples are task 0's, so every
    stretch of 7 should hold about 5 of them, not none (a run of the seven small tasks)."""
    sampler = MultiTaskDistributedSampler(
        [16, 1, 1, 1, 1, 1, 1, 1], num_replicas=1, rank=0, shuffle=False
    )
    labels = sampler.task_of(sampler.indices()).tolist()
    assert sorted(labels) == [0] * 16 + [1, 2, 3, 4, 5, 6, 7]
    errors = window_errors(labels, 8, 7)
    assert errors[0] <= 2, labels


def test_four_tasks_of_one_size_do_not_cluster() -> None:
    """Proportional over [8, 1, 1, 1]: the three small tasks' samples should not sit together."""
    sampler = MultiTaskDistributedSampler([8, 1, 1, 1], num_replicas=1, rank=0, shuffle=False)
    labels = sampler.task_of(sampler.indices()).tolist()
    assert max(window_errors(labels, 4, 3)) <= 2, labels


# -- the order over epochs ------------------------------------------------------------------


@profile
@given(task_cases())
def test_the_order_is_decided_by_seed_and_epoch(case: TaskCase) -> None:
    first = draw(case)
    assert draw(case) == first
    again = draw(case, case.epoch + 1)
    counts = multitask(case, 0).counts()
    if not any(first):  # nothing dealt (drop_last, an epoch shorter than the world)
        assert not any(again)
    elif not case.shuffle:
        # The stream is each task's indices in order, over and over: the next epoch is the
        # same only when the count of every task drawn is whole passes.
        moves = zip(counts, case.sizes, strict=True)
        same = all(count % size == 0 for count, size in moves if count)
        assert (again == first) == same
    elif any(count and size >= 10 for count, size in zip(counts, case.sizes, strict=True)):
        assert again != first


def test_another_seed_gives_another_order() -> None:
    one = MultiTaskDistributedSampler([40, 60], num_replicas=2, rank=0, seed=1)
    two = MultiTaskDistributedSampler([40, 60], num_replicas=2, rank=0, seed=2)
    assert list(one) != list(two)
    assert sorted(one.task_of(one.indices()).tolist()) == sorted(
        two.task_of(two.indices()).tolist()
    )


def test_the_epoch_is_fixed_when_iteration_starts() -> None:
    sampler = MultiTaskDistributedSampler([30, 7], num_replicas=3, rank=2, seed=4)
    expected = list(sampler)
    started = iter(sampler)
    sampler.set_epoch(1)
    assert list(started) == expected
    assert list(sampler) != expected


# -- bad input ------------------------------------------------------------------------------


def build(**kwargs: object) -> MultiTaskDistributedSampler:
    arguments: dict[str, object] = {"tasks": [3, 4], "num_replicas": 2, "rank": 0, **kwargs}
    return MultiTaskDistributedSampler(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tasks": []}, r"tasks: none given"),
        ({"tasks": [3, 0, 4]}, r"tasks: task 1 has size 0"),
        ({"tasks": [3, 4, -2]}, r"tasks: task 2 has size -2"),
        ({"mixing": "weights", "weights": [1.0]}, r"weights: 1 given for 2 tasks"),
        ({"mixing": "weights", "weights": [1, 2, 3]}, r"weights: 3 given for 2 tasks"),
        ({"mixing": "weights", "weights": [1.0, -0.5]}, r"weights\[1\]: .* >= 0, not -0\.5"),
        ({"mixing": "weights", "weights": [0, 0]}, r"weights: \[0, 0\] add up to 0"),
        ({"mixing": "weights", "weights": [1.0, math.nan]}, r"weights\[1\]: .*, not nan"),
        ({"mixing": "weights", "weights": [1.0, math.inf]}, r"weights\[1\]: .*, not inf"),
        ({"mixing": "balanced", "weights": [1, 2]}, r"weights: give them with mixing 'weights'"),
        ({"weights": [1, 2]}, r"weights: give them with mixing 'weights'"),
        ({"mixing": "weights"}, r"weights: give them with mixing 'weights'"),
        ({"mixing": "uniform"}, r"mixing: must be one of 'balanced', .*, not 'uniform'"),
        ({"mixing": "temperature", "temperature": 0}, r"temperature: .* > 0, not 0$"),
        ({"mixing": "temperature", "temperature": -1.5}, r"temperature: .* > 0, not -1\.5"),
        ({"mixing": "temperature", "temperature": math.nan}, r"temperature: .*, not nan"),
        ({"mixing": "temperature", "temperature": math.inf}, r"temperature: .*, not inf"),
        ({"temperature": 0.0}, r"temperature: must be a finite number > 0, not 0\.0"),
        ({"epoch_size": 0}, r"epoch_size: must be 'sum', 'max' or an int >= 1, not 0"),
        ({"epoch_size": -5}, r"epoch_size: .*, not -5"),
        ({"epoch_size": "foo"}, r"epoch_size: .*, not 'foo'"),
        ({"rank": 2}, r"rank: must be an int from 0 to 1, not 2"),
        ({"rank": -1}, r"rank: must be an int from 0 to 1, not -1"),
        ({"num_replicas": 0}, r"num_replicas: must be an int >= 1, not 0"),
        ({"chunk_size": 0}, r"chunk_size: must be an int >= 1, not 0"),
        ({"batch_size": 0}, r"batch_size: must be an int >= 1, not 0"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_value(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build(**kwargs)


# -- task ids -------------------------------------------------------------------------------


def listed(values: Iterable[int]) -> Dataset[int]:
    """A list of ints as a dataset (a list is one to ``ConcatDataset``)."""
    return cast("Dataset[int]", list(values))


def test_samples_end_with_their_task() -> None:
    tasks = WithTaskIds(
        [
            TensorDataset(torch.arange(3), torch.arange(3) * 10),
            listed([7, 8]),  # samples that are not tuples
            TensorDataset(torch.arange(4)),
        ]
    )
    assert len(tasks) == 9
    assert tasks[0] == (0, 0, 0)
    assert tasks[2] == (2, 20, 0)
    assert tasks[3] == (7, 1)
    assert tasks[4] == (8, 1)
    assert tasks[5] == (0, 2)
    assert tasks[8] == (3, 2)
    assert tasks[-1] == tasks[8]
    assert tasks[-6] == tasks[3]
    assert tasks[-9] == tasks[0]


def test_an_index_out_of_range_is_refused_as_by_concat_dataset() -> None:
    tasks = WithTaskIds([listed([1, 2, 3]), listed([4, 5])])
    with pytest.raises(IndexError):
        tasks[5]
    # ConcatDataset refuses an index below -len; WithTaskIds must not wrap it around twice
    # (today it returns (5, 0): the last sample, labelled with the first task).
    with pytest.raises(ValueError, match="absolute value of index"):
        tasks[-6]


def test_task_ids_agree_with_the_multitask_sampler() -> None:
    tasks = WithTaskIds([listed(range(n)) for n in (4, 1, 6)])
    for rank in range(3):
        sampler = MultiTaskDistributedSampler(
            tasks, num_replicas=3, rank=rank, mixing="balanced", seed=rank
        )
        assert sampler.sizes == [4, 1, 6]
        indices = list(sampler)
        assert len(indices) == len(sampler) == 4
        expected = sampler.task_of(torch.tensor(indices)).tolist()
        assert [tasks[i][-1] for i in indices] == expected
        assert [tasks[i][0] for i in indices] == [
            i - sampler.offsets[t] for i, t in zip(indices, expected, strict=True)
        ]
