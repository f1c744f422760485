"""The ``multitask`` sampler: a distributed sampler over several tasks, mixed as the user says.

torch's ``DistributedSampler`` over a ``ConcatDataset`` treats the tasks as one flat list: how
often each task is seen is an accident of its size, and a rank's share of a task is left to
chance. This sampler decides, per epoch, how many samples each task gets (its *mixing*), draws
them from the task without replacement within a pass over it, mixes the tasks evenly into one
stream for the epoch, and deals that stream to the ranks so that the ranks take, step by step,
what one process would: ``W`` ranks of batch ``b`` train on the samples one process of batch
``W·b`` trains on, whatever ``W``.

Each task is an endless stream of passes over its samples, each pass a fresh permutation
(drawn for the seed, the task and the pass, one that gives any of its positions on its own).
An epoch's samples of a task are its count ``c`` in the epoch, the stream's positions ``e·c``
to ``(e+1)·c - 1`` for epoch ``e``: a small task over-sampled runs through several passes, none
repeating a sample within a pass; a large task under-sampled moves on through its pass, epoch
by epoch; a task whose count is its size reads each pass in one epoch. None of this depends on
the number of ranks.

The epoch's *global stream* puts the tasks' samples one after another as a binary tree of even
merges: at each node, of the first ``p`` samples, ``round(p·a / n)`` come from the left subtree
(``a`` of its ``n`` samples), so every task is spread evenly over the epoch, and how many of a
task's samples precede any position is a closed formula: a rank finds the samples it takes
without building the stream. The stream is dealt in *blocks* of ``W x batch`` consecutive
samples, a global batch each: every rank takes ``batch`` samples of the block, the block sorted
by task and dealt round-robin (rotated by one rank each block), so every rank's batch holds
every task's share of the global batch within one sample. On more ranks the epoch is padded to
a multiple of them by repeating its first samples (as torch's ``DistributedSampler`` pads).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import torch
from torch.utils.data import ConcatDataset

from ups.core import ConfigError, RunContext
from ups.core.config import (
    ArgumentValueError,
    boolean,
    check_type,
    choice,
    integer,
    number,
    wrong_type,
    wrong_value,
)

from ._epoch import (
    EpochSampler,
    Lookup,
    Places,
    Rest,
    Segment,
    apportion,
    index_dtype,
    positions,
)
from ._permute import shuffled

Mixing = Literal["balanced", "proportional", "temperature", "weights"]
EpochSize = Literal["sum", "max"] | int

MIXINGS: tuple[str, ...] = ("balanced", "proportional", "temperature", "weights")

DEALING = 2
"""The state's ``dealing``: 2, one global stream dealt in blocks (none: an older, per-world
dealing, whose mid-epoch states cannot be continued)."""

CHUNK = 1 << 16
"""Positions drawn at a time."""


TASKS = "a ConcatDataset (one dataset a task) or a sequence of the tasks' sizes"
EPOCH_SIZES = "'sum', 'max' or an int >= 1"


def task_sizes(tasks: Sequence[int] | ConcatDataset[Any]) -> list[int]:
    """The tasks' sizes: given, or those of a ``ConcatDataset``'s parts (one per task).

    :raises TypeError: naming ``tasks``, for neither.
    :raises ValueError: naming ``tasks``, for no task or a task of size < 1.
    """
    if isinstance(tasks, ConcatDataset):
        sizes = [len(part) for part in tasks.datasets]  # type: ignore[arg-type]
    else:
        check_type("tasks", tasks, Sequence, TASKS)
        sizes = [integer(f"tasks[{t}]", size) for t, size in enumerate(tasks)]
    if not sizes:
        raise ArgumentValueError("tasks", "none given; give at least one task")
    for t, size in enumerate(sizes):
        if size < 1:
            raise ArgumentValueError(
                "tasks", f"task {t} has size {size}; every task needs a sample"
            )
    return sizes


def check_mixing(
    mixing: str, temperature: float, weights: Sequence[float] | None, epoch_size: object
) -> None:
    """Check the mixing options on their own (the task sizes aside).

    :raises TypeError: naming the option of the wrong type, and what is allowed.
    :raises ValueError: naming the bad option and value, and what is allowed.
    """
    choice("mixing", mixing, MIXINGS)
    number("temperature", temperature, above=0)
    if weights is not None:
        check_type("weights", weights, Sequence, "a sequence of numbers, one a task, or None")
        for t, weight in enumerate(weights):
            number(f"weights[{t}]", weight, at_least=0)
        if not sum(weights) > 0:
            raise ArgumentValueError(
                "weights", f"{list(weights)} add up to 0; at least one must be > 0"
            )
    if (weights is not None) != (mixing == "weights"):
        raise ArgumentValueError("weights", "give them with mixing 'weights', and only then")
    if not (isinstance(epoch_size, str) and epoch_size in ("sum", "max")):
        if isinstance(epoch_size, bool) or not isinstance(epoch_size, int | str):
            raise wrong_type("epoch_size", epoch_size, EPOCH_SIZES)
        if isinstance(epoch_size, str) or epoch_size < 1:
            raise wrong_value("epoch_size", epoch_size, EPOCH_SIZES)


def mixture(
    sizes: Sequence[int],
    mixing: Mixing,
    *,
    temperature: float = 2.0,
    weights: Sequence[float] | None = None,
) -> list[float]:
    """The share of the epoch each task gets (they add up to 1).

    ``balanced``: the same for every task; ``proportional``: by size; ``temperature``: by
    ``size ** (1 / temperature)`` (1 is proportional; higher flattens towards balanced);
    ``weights``: by the given weights.

    :raises ValueError: naming the bad value.
    """
    check_mixing(mixing, temperature, weights, "sum")
    if mixing == "balanced":
        raw = [1.0] * len(sizes)
    elif mixing == "proportional":
        raw = [float(size) for size in sizes]
    elif mixing == "temperature":
        raw = [size ** (1 / temperature) for size in sizes]
    else:
        assert weights is not None
        raw = [float(w) for w in weights]
        if len(raw) != len(sizes):
            raise ValueError(f"weights: {len(raw)} given for {len(sizes)} tasks; give one a task")
    whole = sum(raw)
    return [w / whole for w in raw]


def epoch_length(sizes: Sequence[int], shares: Sequence[float], epoch_size: EpochSize) -> int:
    """Samples in an epoch: ``sum`` of the task sizes, ``max``: enough that every task with
    a share is seen in full at least once, or the number given."""
    check_mixing("balanced", 1.0, None, epoch_size)
    if epoch_size == "sum":
        return sum(sizes)
    if epoch_size == "max":
        return max(math.ceil(n / p - 1e-9) for n, p in zip(sizes, shares, strict=True) if p > 0)
    assert isinstance(epoch_size, int)
    return epoch_size


class MultiTaskDistributedSampler(EpochSampler):
    """A distributed sampler over tasks mixed by ``mixing``, dealt as one global stream.

    The dataset is the tasks one after the other, as a ``ConcatDataset`` lays them out: task
    ``t``'s samples are indices ``offset[t] .. offset[t] + size[t] - 1``.

    Per epoch, task ``t`` gets ``count[t]`` of the epoch's samples: its share of the epoch
    length (:func:`mixture`, :func:`epoch_length`), whole counts by largest remainder, so each
    is within one of its exact share; with ``proportional`` and ``sum`` every epoch is one pass
    over every task. The counts, the epoch's samples and their order in the global stream
    depend on the seed, the epoch and the mixing, never on the number of ranks.

    The stream is dealt in blocks of ``num_replicas x batch_size`` samples (set the batch size
    each rank's loader takes, as ups's engine does through :meth:`set_batch_size`): the samples
    of global batch ``t`` on ``W`` ranks of batch ``b`` are the samples of batch ``t`` on one
    process of batch ``W·b`` (and those of ``W`` batches of ``b`` on one process), and within
    every global batch each rank holds each task's count in it divided by ``W``, within one.
    The epoch is padded to a multiple of the ranks by repeating its first samples (or, with
    ``drop_last``, its tail is dropped): at most ``W - 1`` samples, at the epoch's end.

    :param tasks: the tasks' sizes, or a ``ConcatDataset`` of one dataset per task.
    :param mixing: ``balanced``, ``proportional``, ``temperature`` or ``weights``.
    :param temperature: for ``temperature``: shares by ``size ** (1 / temperature)``.
    :param weights: for ``weights``: one per task, >= 0, not all 0.
    :param epoch_size: ``sum`` (the tasks' total), ``max`` (every task seen in full at least
        once) or a number of samples.
    :param shuffle: draw each pass over a task in a random order (else in index order).
    :param drop_last: round the epoch down to a multiple of the ranks, not up (not with
        ``epoch_size="max"``).
    :param batch_size: the samples each rank takes per batch (the block it is dealt in).
    :raises TypeError: naming an argument of the wrong type (``temperature="hot"``, a
        ``TensorDataset`` for ``tasks``, ``seed="0"``, ``shuffle="no"``), and what is allowed.
    :raises ValueError: naming the bad value: no tasks, a task of size < 1, a bad mixing,
        temperature, weight, epoch size or batch size, a rank out of range.
    """

    def __init__(
        self,
        tasks: Sequence[int] | ConcatDataset[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        *,
        mixing: Mixing = "proportional",
        temperature: float = 2.0,
        weights: Sequence[float] | None = None,
        epoch_size: EpochSize = "sum",
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        batch_size: int = 1,
        chunk_size: int = 8192,
    ) -> None:
        super().__init__(num_replicas, rank, seed=seed, drop_last=drop_last, chunk_size=chunk_size)
        self.sizes = task_sizes(tasks)
        self.mixing = mixing
        self.shares = mixture(self.sizes, mixing, temperature=temperature, weights=weights)
        self.temperature = temperature
        self.epoch_size = epoch_size
        self.length = epoch_length(self.sizes, self.shares, epoch_size)
        if epoch_size == "max":  # on until every task with a share is seen in full
            while any(
                c < n
                for c, n, p in zip(self.counts(), self.sizes, self.shares, strict=True)
                if p > 0
            ):
                self.length += 1
        self.shuffle = boolean("shuffle", shuffle)
        self.batch_size = 1
        self.set_batch_size(batch_size)
        ends = torch.tensor(self.sizes, dtype=torch.int64).cumsum(0)
        self.offsets = [0, *ends[:-1].tolist()]
        self._ends = ends
        self._dtype = index_dtype(int(ends[-1]))
        counts = self.counts()
        self._firsts = torch.tensor([0, *itertools.accumulate(counts)][:-1])
        anchor = min(range(len(counts)), key=lambda t: (counts[t] or self.length, t))
        self._tree = MergeTree(counts, anchor)
        """The global stream, anchored on the smallest task (see :meth:`_occurrences`)."""

    def counts(self) -> list[int]:
        """Samples of each task in an epoch (the same on any number of ranks)."""
        return apportion(self.length, self.shares)

    def set_batch_size(self, batch_size: int) -> None:
        """Deal the stream in blocks of ``batch_size`` samples per rank from the next
        iteration on (the batch each rank's loader takes; ups's engine sets it).

        :raises TypeError: for a batch size not an int.
        :raises ValueError: for a batch size below 1.
        """
        self.batch_size = integer("batch_size", batch_size, low=1)

    def _block(self) -> int:
        return self.batch_size

    def _pool_size(self, num_replicas: int) -> int:
        return self.length

    def _total(self, size: int, num_replicas: int) -> int:
        if self.epoch_size == "max":  # round up, whatever drop_last says: every task in full
            return -(-size // num_replicas) * num_replicas
        return super()._total(size, num_replicas)

    def _pool(self, epoch: int, num_replicas: int, block: int) -> torch.Tensor:
        return self._lookup(epoch, num_replicas, block)(slice(None))

    def _lookup(self, epoch: int, num_replicas: int, block: int) -> Lookup:
        return functools.partial(self._dealt, epoch, num_replicas, num_replicas * block, 0)

    def _places(self, epoch: int, num_replicas: int, block: int) -> Places:
        return functools.partial(self._placed, epoch, num_replicas, num_replicas * block, 0)

    def _continued(self, segments: list[Segment], num_replicas: int, block: int) -> Rest | None:
        """After whole blocks on every earlier world, the rest of the stream from where the
        ranks stopped, dealt in this world's blocks."""
        if any(taken % block for _, taken, block in segments):
            return None
        start = 0
        for size, taken, _ in segments:
            if taken >= self._total(self.length - start, size) // size:
                start = self.length  # that world finished the epoch
                break
            start += size * taken
        ranks, block = num_replicas, num_replicas * block
        return Rest(
            functools.partial(self._dealt, self.epoch, ranks, block, start),
            functools.partial(self._placed, self.epoch, ranks, block, start),
            max(0, self.length - start),
        )

    def _dealt(
        self, epoch: int, num_replicas: int, block: int, start: int, where: slice
    ) -> torch.Tensor:
        """The samples at positions ``where`` of the stream from ``start`` on, dealt to
        ``num_replicas`` ranks in blocks of ``block``: which task's which sample each is, a chunk
        at a time (O(share x log tasks)), then each task's drawn at once."""
        first, stop, step = where.indices(max(0, self.length - start))
        wanted = range(first, max(first, stop), step)
        # Kept small until each task's samples are drawn, in one call a task.
        task = torch.empty(len(wanted), dtype=torch.int32)
        k = torch.empty(len(wanted), dtype=index_dtype(self.length))
        for at in range(0, len(wanted), CHUNK):
            chunk = wanted[at : at + CHUNK]
            here = positions(chunk.start, chunk.stop, step, torch.int64)
            found_task, found_k = self._occurrences(epoch, num_replicas, block, start, here)
            task[at : at + CHUNK], k[at : at + CHUNK] = found_task, found_k
        return self._drawn(epoch, task, k)

    def _placed(
        self, epoch: int, num_replicas: int, block: int, start: int, where: torch.Tensor
    ) -> torch.Tensor:
        """The places of the samples at positions ``where`` (ascending) of the stream from
        ``start`` on: sample ``k`` of task ``t`` in the epoch is place ``count[:t].sum() + k``,
        whatever the ranks."""
        task, k = self._occurrences(epoch, num_replicas, block, start, where)
        return self._firsts[task] + k

    def _occurrences(
        self, epoch: int, num_replicas: int, block: int, start: int, where: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The task of the samples at positions ``where`` (ascending) of the stream from
        ``start`` on, and which of the task's samples in the epoch each is.

        Each block is sorted by task and dealt round-robin, so that rank ``r``'s positions
        (every ``num_replicas``-th) take each task's count in the block divided by the ranks,
        within one. The round starts where the smallest task's own round-robin over the epoch
        stands: its ``k``-th sample of the epoch goes to rank ``k mod num_replicas`` (the
        whole epoch within one of its share on every rank; with two tasks, both). A last block
        that the ranks cannot share evenly is not rotated."""
        number = where // block
        blocks, inverse = torch.unique_consecutive(number, return_inverse=True)
        begin = start + blocks * block
        end = (begin + block).clamp(max=self.length)
        length = (end - begin)[inverse]
        offset = where - number * block
        rotation = self._tree.rotation(begin, end)[inverse]
        at = torch.where(
            length % num_replicas == 0, (offset + rotation) % length.clamp(min=1), offset
        )
        return self._tree.find(begin[inverse], end[inverse], at)

    def _drawn(self, epoch: int, task: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The dataset index of sample ``k`` of each ``task`` in ``epoch``: position
        ``epoch·count + k`` of the task's stream of passes, each pass a permutation drawn for
        (seed, task, pass) that gives any position on its own (:func:`shuffled`)."""
        drawn = torch.empty(len(k), dtype=self._dtype)
        for t, (count, size, offset) in enumerate(
            zip(self.counts(), self.sizes, self.offsets, strict=True)
        ):
            mine = (task == t).nonzero().squeeze(1)
            if not len(mine):
                continue
            stream = k[mine].to(torch.int64) + epoch * count
            index = stream % size
            if self.shuffle:
                index = shuffled(index, size, (self.seed, t), stream // size)
            drawn[mine] = (index + offset).to(self._dtype)
        return drawn

    def task_of(self, indices: torch.Tensor) -> torch.Tensor:
        """The task of each dataset index."""
        return torch.searchsorted(self._ends, indices.to(torch.int64), right=True)

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "sizes": list(self.sizes),
            "shares": list(self.shares),
            "length": self.length,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dealing": DEALING,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """As :meth:`EpochSampler.load_state_dict`.

        :raises ValueError: also for a state saved mid-epoch by an older ups-samplers, whose
            epochs depended on the world size and cannot be continued exactly.
        """
        if state.get("dealing") is None and state.get("sampler") == type(self).__name__:
            if state.get("segments"):
                raise ValueError(
                    "sampler state: saved mid-epoch by an ups-samplers older than 0.2, whose "
                    "multitask epochs depended on the world size; it cannot be continued "
                    "exactly: resume from a checkpoint saved at an epoch's end"
                )
            state = {**state, "dealing": DEALING}
        super().load_state_dict(state)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(tasks={len(self.sizes)}, mixing={self.mixing!r}, "
            f"length={self.length}, num_replicas={self.num_replicas}, rank={self.rank}, "
            f"seed={self.seed}, epoch={self.epoch}, batch_size={self.batch_size})"
        )


class MergeTree:
    """The epoch's global stream: the tasks merged as a balanced binary tree (the tasks padded
    with empty ones to a power of two). Of the first ``p`` samples of a node, ``(p·a + n // 2)
    // n`` come from its left half (``a`` of its ``n``): never decreasing, stepping by one at
    most, ending at ``a``; so every task is spread evenly over the stream, and what sits at a
    position is found by walking down the tree, O(log tasks) per position."""

    def __init__(self, counts: Sequence[int], anchor: int) -> None:
        self.depth = max(len(counts) - 1, 0).bit_length()
        padded = [*counts, *[0] * ((1 << self.depth) - len(counts))]
        self.left: list[torch.Tensor] = []
        self.total: list[torch.Tensor] = []
        for level in range(self.depth):
            width = len(padded) >> level
            nodes = torch.tensor(padded).view(-1, width)
            self.left.append(nodes[:, : width // 2].sum(1))
            self.total.append(nodes.sum(1))
        self.anchor = anchor

    def _split(
        self, level: int, node: torch.Tensor | int, begin: torch.Tensor, end: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """How many of a node's first ``begin`` and first ``end`` samples its left half gives
        (one node, ``node`` an int: numbers, not a gather a position)."""
        if isinstance(node, int):
            a, n = int(self.left[level][node]), int(self.total[level][node])
            return (begin * a + n // 2) // max(n, 1), (end * a + n // 2) // max(n, 1)
        left, total = self.left[level][node], self.total[level][node]
        half, whole = total // 2, total.clamp(min=1)
        return (begin * left + half) // whole, (end * left + half) // whole

    def find(
        self, begin: torch.Tensor, end: torch.Tensor, at: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The task of position ``at`` of each block ``[begin, end)`` of the stream sorted by
        task, and which of the task's samples of the epoch it is."""
        node: torch.Tensor | int = 0  # every position starts at the root
        for level in range(self.depth):
            left_begin, left_end = self._split(level, node, begin, end)
            inside = left_end - left_begin
            right = at >= inside
            at = torch.where(right, at - inside, at)
            begin = torch.where(right, begin - left_begin, left_begin)
            end = torch.where(right, end - left_end, left_end)
            node = right + node * 2
        return torch.as_tensor(node).expand_as(at), begin + at

    def rotation(self, begin: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """For each block ``[begin, end)``, where the anchor task's samples start in the block
        sorted by task, less how many of them came before the block: rotated by that, the
        block's round-robin deals the anchor's ``k``-th sample of the epoch to rank ``k mod W``."""
        start = torch.zeros_like(begin)
        node = 0
        for level in range(self.depth):
            left_begin, left_end = self._split(level, node, begin, end)
            right = self.anchor >> (self.depth - 1 - level) & 1
            if right:
                start += left_end - left_begin
                begin, end = begin - left_begin, end - left_end
            else:
                begin, end = left_begin, left_end
            node = node * 2 + right
        return start - begin


@attrs.frozen(kw_only=True)
class MultiTaskSamplerOptions:
    """Options of the ``multitask`` sampler (see :class:`MultiTaskDistributedSampler`)."""

    mixing: Mixing = "proportional"
    """``balanced`` (every task as often), ``proportional`` (by size), ``temperature``
    (by ``size ** (1 / temperature)``) or ``weights`` (by ``weights``)."""
    temperature: float = 2.0
    """For ``mixing: temperature``; 1 is proportional, higher is closer to balanced."""
    weights: tuple[float, ...] | None = None
    """For ``mixing: weights``: one per task, in task order."""
    epoch_size: Literal["sum", "max"] | int = "sum"
    """Samples an epoch: ``sum`` of the task sizes, ``max`` (every task seen in full at least
    once), or a number."""
    shuffle: bool = True
    """Draw each pass over a task in a new random order."""
    drop_last: bool = False
    """Round the epoch down to a multiple of the ranks instead of up (not with ``max``)."""

    def __attrs_post_init__(self) -> None:
        check_mixing(self.mixing, self.temperature, self.weights, self.epoch_size)


def multitask_sampler(
    dataset: Any, *, ctx: RunContext, seed: int, options: MultiTaskSamplerOptions
) -> MultiTaskDistributedSampler:
    """The ``multitask`` sampler's factory: the data must be a ``ConcatDataset``, one part a
    task (as ``data.tasks`` names them)."""
    if not isinstance(dataset, ConcatDataset):
        raise ConfigError(
            "data.factory",
            f"returns a {type(dataset).__name__}; sampler 'multitask' needs a ConcatDataset, "
            "one dataset per task",
        )
    try:
        return MultiTaskDistributedSampler(
            dataset,
            num_replicas=ctx.world_size,
            rank=ctx.rank,
            seed=seed,
            **attrs.asdict(options),
        )
    except ValueError as error:
        raise ConfigError("sampler.options", str(error)) from None
