"""What every sampler of this distribution shares: an epoch's samples dealt to the ranks, handed
out in chunks, and a state to resume from mid-epoch, on as many ranks or on another number.

An epoch is a *pool*: the epoch's samples, in order, as one tensor. Rank ``r`` of ``W`` takes
the pool's positions ``r, r + W, ...`` (a sampler that can draw some positions of a pool
without the rest, as ``multitask`` can, draws only those), which it may then reorder
(``_arrange``);
unless the shares may differ in length, the shortest are padded by wrapping around to the
pool's start (or, with ``drop_last``, the pool's tail is dropped), as torch's
``DistributedSampler`` does. Padding always comes last in a share. A pool may depend on the
world size and on a *block* (the samples each rank takes per block: ``multitask`` deals its
epoch in blocks of ``W x batch size``), never on more.

The state of an epoch in progress is the list of ``(world size, samples taken per rank,
block)`` segments it went through. On as many ranks and the same block, resuming slices this
rank's share: ``O(1)`` past building the epoch. Otherwise a sampler may continue the epoch
from where the ranks stopped (``_continued``); if it cannot, the samples no rank has taken yet
(padding left out) become the pool, dealt anew to the new ranks: each is seen once, plus the
padding (or less the tail, with ``drop_last``) that dealing to the new ranks needs, as ever.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ups.core.config import boolean, integer

INT32_MAX = torch.iinfo(torch.int32).max

Lookup = Callable[[slice], torch.Tensor]
"""A pool's samples at the positions of a slice (``start:stop:step``)."""

Places = Callable[[torch.Tensor], torch.Tensor]
"""The places (see :meth:`EpochSampler.places`) of a pool's samples at some positions."""


@attrs.frozen
class Rest:
    """The pool a world deals: what gives its samples and their places at some positions,
    and its size."""

    at: Lookup
    places: Places
    size: int


SIZED = "a dataset with a length (only len(dataset) is used)"
"""What a sampler's ``dataset`` must be, as its error says."""

Segment = tuple[int, int, int]
"""``(world size, samples each rank has taken, block)``: a stretch of an epoch on one world
size, dealt in one block."""


def index_dtype(size: int) -> torch.dtype:
    """int32 when every index below ``size`` fits, else int64."""
    return torch.int32 if size - 1 <= INT32_MAX else torch.int64


def seeded(*parts: int) -> torch.Generator:
    """A CPU generator seeded from ``parts`` (well mixed: nearby seeds are unrelated)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return generator


def positions(start: int, stop: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    """``start, start + step, ...`` below ``stop``, like ``range`` (empty when start >= stop)."""
    return torch.arange(start, max(start, stop), step, dtype=dtype)


def world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """The world size and rank, from the default process group where not given; checked.

    :raises ArgumentTypeError: (a ``TypeError``) naming a world size or rank not an int.
    :raises ArgumentValueError: (a ``ValueError``) naming one out of range.
    """
    if num_replicas is None:
        num_replicas = dist.get_world_size()
    if rank is None:
        rank = dist.get_rank()
    size = integer("num_replicas", num_replicas, low=1)
    return size, integer("rank", rank, low=0, high=size - 1)


class EpochSampler(Sampler[int]):
    """The shared machinery of this distribution's samplers (see the module's docstring).

    Subclasses build the pool (:meth:`_pool`), may reorder a rank's share (:meth:`_arrange`),
    and say what a saved state must match (:meth:`_fingerprint`).
    """

    pad = True
    """Pad the shorter shares (or drop the tail, with ``drop_last``) so all have one length."""

    def __init__(
        self,
        num_replicas: int | None,
        rank: int | None,
        *,
        seed: int,
        drop_last: bool,
        chunk_size: int,
    ) -> None:
        self.num_replicas, self.rank = world(num_replicas, rank)
        self.seed = integer("seed", seed)
        self.drop_last = boolean("drop_last", drop_last)
        self.chunk_size = integer("chunk_size", chunk_size, low=1)
        self.epoch = 0
        self._pending: list[Segment] | None = None
        self._active: tuple[list[Segment], int, int, Rest] | None = None
        self._taken_before = 0
        self._chunk: Iterator[int] = iter(())
        self._chunk_len = 0

    # -- what subclasses define --------------------------------------------------------------

    def _pool(self, epoch: int, num_replicas: int, block: int) -> torch.Tensor:
        """The epoch's samples, in the order the ranks are dealt them, for ``num_replicas``
        ranks taking ``block`` samples each per block."""
        raise NotImplementedError

    def _lookup(self, epoch: int, num_replicas: int, block: int) -> Lookup:
        """What gives the epoch's pool at some positions: by default, the built pool's own
        indexing; a subclass that can draw some positions without the rest overrides it."""
        return self._pool(epoch, num_replicas, block).__getitem__

    def _block(self) -> int:
        """The block this sampler deals in now (see the module's text); 1 by default."""
        return 1

    def _places(self, epoch: int, num_replicas: int, block: int) -> Places:
        """The places of the epoch's pool at some positions: by default the positions, which
        do not depend on the world size where the pool does not."""
        return lambda where: where.to(torch.int64)

    def _continued(self, segments: list[Segment], num_replicas: int, block: int) -> Rest | None:
        """The rest of the epoch after ``segments``, as a pool for ``num_replicas`` ranks and
        ``block``, for a sampler that can continue an epoch itself; ``None``: deal what no rank
        has taken anew (the default)."""
        return None

    def _pool_size(self, num_replicas: int) -> int:
        """``len(self._pool(epoch, num_replicas))``, without building it."""
        raise NotImplementedError

    def _fingerprint(self) -> dict[str, Any]:
        """What decides the epochs, beyond ``seed``: a state loads only into its equal."""
        raise NotImplementedError

    # -- dealing -----------------------------------------------------------------------------

    def _total(self, size: int, num_replicas: int) -> int:
        """The dealt length of a pool of ``size``: padded or dropped to a multiple of the world."""
        if not self.pad:
            return size
        if self.drop_last:
            return size // num_replicas * num_replicas
        return -(-size // num_replicas) * num_replicas

    def _real(self, size: int, num_replicas: int, rank: int) -> int:
        """How many samples of a pool of ``size`` rank ``rank`` gets, padding left out."""
        return len(range(rank, min(size, self._total(size, num_replicas)), num_replicas))

    def _share(self, at: Lookup, size: int, num_replicas: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s share of a pool of ``size`` (its samples at some positions given
        by ``at``), padding last."""
        mine = at(slice(rank, min(size, self._total(size, num_replicas)), num_replicas))
        padding = self._padding(size, num_replicas, rank)
        if padding is None:
            return mine
        return torch.cat((mine, at(slice(padding, padding + 1))))

    def _padding(self, size: int, num_replicas: int, rank: int) -> int | None:
        """The pool position rank ``rank`` repeats as padding, if it pads: positions
        ``size .. total - 1`` wrap around to the pool's start, fewer than the ranks, so a rank
        pads with one sample at most."""
        padding = size + (rank - size) % num_replicas
        if padding >= self._total(size, num_replicas):
            return None
        return padding % size

    def _remaining(self, pool: torch.Tensor, num_replicas: int, taken: int) -> torch.Tensor:
        """The samples of ``pool`` that no rank has taken after ``taken`` each (padding left
        out), interleaved in dealing order: the pool of what is left of the epoch."""
        rows = [
            self._share(pool.__getitem__, len(pool), num_replicas, r)[
                taken : self._real(len(pool), num_replicas, r)
            ]
            for r in range(num_replicas)
        ]
        width = max((len(row) for row in rows), default=0)
        grid = torch.full((num_replicas, width), -1, dtype=torch.int64)
        for r, row in enumerate(rows):
            grid[r, : len(row)] = row
        left = grid.t().reshape(-1)
        return left[left >= 0].to(pool.dtype)

    def _split(self, segments: list[Segment]) -> tuple[list[Segment], int]:
        """``segments`` as the segments before this world's, and what this rank has taken in
        its own (a last segment of this world size and block), if any."""
        if segments and segments[-1][0] == self.num_replicas and segments[-1][2] == self._block():
            return segments[:-1], segments[-1][1]
        return segments, 0

    def _rest(
        self, segments: list[Segment], num_replicas: int | None = None, block: int | None = None
    ) -> Rest:
        """The pool ``num_replicas`` ranks dealing in ``block`` (default: this world's) deal
        after ``segments``: the epoch's own, or its continuation, or what the ranks of the last
        segment left of the pool they dealt (whose places come after every place taken before,
        so that no two samples of an epoch share one)."""
        num_replicas = num_replicas or self.num_replicas
        block = block or self._block()
        if not segments:
            return Rest(
                self._lookup(self.epoch, num_replicas, block),
                self._places(self.epoch, num_replicas, block),
                self._pool_size(num_replicas),
            )
        continued = self._continued(segments, num_replicas, block)
        if continued is not None:
            return continued
        size, taken, dealt_in = segments[-1]
        dealt = self._rest(segments[:-1], size, dealt_in)
        pool = self._remaining(dealt.at(slice(None)), size, taken)
        base = self._pool_size(segments[0][0]) + sum(size * taken for size, taken, _ in segments)
        return Rest(pool.__getitem__, lambda where: where.to(torch.int64) + base, len(pool))

    def _sequence(self, rest: Rest, skip: int) -> torch.Tensor:
        """This rank's samples of ``rest``, past the first ``skip``."""
        return self._share(rest.at, rest.size, self.num_replicas, self.rank)[skip:]

    def _rest_size(
        self, segments: list[Segment], num_replicas: int | None = None, block: int | None = None
    ) -> int:
        """``self._rest(segments, num_replicas, block).size``, by arithmetic alone where no
        continuation is given."""
        num_replicas = num_replicas or self.num_replicas
        block = block or self._block()
        if not segments:
            return self._pool_size(num_replicas)
        continued = self._continued(segments, num_replicas, block)
        if continued is not None:
            return continued.size
        size, taken, dealt_in = segments[-1]
        dealt = self._rest_size(segments[:-1], size, dealt_in)
        return sum(max(0, self._real(dealt, size, r) - taken) for r in range(size))

    def _length(self, segments: list[Segment], skip: int) -> int:
        """``len(self._sequence(segments, skip))``, by arithmetic alone."""
        size = self._rest_size(segments)
        if self.pad:
            length = self._total(size, self.num_replicas) // self.num_replicas
        else:
            length = self._real(size, self.num_replicas, self.rank)
        return max(0, length - skip)

    # -- the Sampler -------------------------------------------------------------------------

    def indices(self) -> torch.Tensor:
        """This rank's indices for the next iteration, in order, as a 1-D integer tensor (the
        rest of the epoch after :meth:`load_state_dict`)."""
        segments, skip = self._split(self._pending or [])
        return self._sequence(self._rest(segments), skip)

    def __iter__(self) -> Iterator[int]:
        # The epoch's indices are drawn now, as torch's sampler does, not at the first next().
        segments, skip = self._split(self._pending or [])
        self._pending = None
        rest = self._rest(segments)
        sequence = self._sequence(rest, skip)
        self._active = (segments, skip, len(sequence), rest)
        self._taken_before, self._chunk, self._chunk_len = 0, iter(()), 0
        return self._hand_out(sequence)

    def _hand_out(self, sequence: torch.Tensor) -> Iterator[int]:
        for chunk in torch.split(sequence, self.chunk_size):
            self._taken_before += self._chunk_len
            self._chunk = iter(chunk.tolist())
            self._chunk_len = len(chunk)
            yield from self._chunk

    def __len__(self) -> int:
        """Indices this rank's current iteration yields: after :meth:`load_state_dict`, what
        is left of the epoch; otherwise the whole epoch's share."""
        if self._pending is not None:
            return self._length(*self._split(self._pending))
        if self._active is not None:
            return self._active[2]
        return self._length([], 0)

    def places(self, first: int, count: int) -> torch.Tensor:
        """The places of the ``count`` samples the current iteration yields from its
        ``first``-th on: a key of each sample's place in the epoch that does not depend on the
        world size where the sampler's global stream does not (its position in the epoch's
        pool; a padding sample repeats the place of the sample it repeats). ups's engine seeds
        each sample's data-side randomness from it.

        :raises RuntimeError: outside an iteration.
        """
        if self._active is None:
            raise RuntimeError("places: no iteration in progress; iterate the sampler first")
        _, skip, _, rest = self._active
        share = torch.arange(skip + first, skip + first + count, dtype=torch.int64)
        real = self._real(rest.size, self.num_replicas, self.rank)
        padding = self._padding(rest.size, self.num_replicas, self.rank) or 0
        where = torch.where(share < real, self.rank + share * self.num_replicas, padding)
        return rest.places(where)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which with ``seed`` decides the order when shuffling.

        Call it before iterating, every epoch, with the same value on every rank. A state
        loaded for another epoch is dropped; one for this epoch is kept.
        """
        if epoch != self.epoch:
            self._pending = None
            self._active = None
        self.epoch = epoch

    # -- the state ---------------------------------------------------------------------------

    def _taken(self) -> int:
        """Indices the current iteration has handed out so far."""
        return self._taken_before + self._chunk_len - operator.length_hint(self._chunk)

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is in the epoch, as plain values; the same on every rank that
        took as many samples (as ranks of one training step do), so rank 0's will do.

        With a ``DataLoader`` of ``num_workers=0`` the count is exact; worker processes
        prefetch, so save the state of the samples the step actually consumed."""
        if self._pending is not None:
            segments = self._pending
        elif self._active is not None:
            before, skip, _, _ = self._active
            segments = [*before, (self.num_replicas, skip + self._taken(), self._block())]
        else:
            segments = []
        return {
            "sampler": type(self).__name__,
            "seed": self.seed,
            **self._fingerprint(),
            "epoch": self.epoch,
            "segments": [list(segment) for segment in segments],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration continues the saved epoch where
        it stopped, with the same sequence on as many ranks (and the same block), and with the
        rest of the epoch dealt anew on another number of ranks (each remaining sample seen
        once, plus padding). A segment saved without its block (``[size, taken]``, by an older
        ups-samplers) was dealt in blocks of one.

        :raises ValueError: naming the value, for a state of another sampler, seed or data.
        """
        expected = {"sampler": type(self).__name__, "seed": self.seed, **self._fingerprint()}
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(
                    f"sampler state: {key} is {state.get(key)!r}, this sampler's is {value!r}; "
                    "load a state into a sampler built as the one that saved it"
                )
        segments = []
        for segment in state["segments"]:
            size, taken, block = (*map(int, segment), 1)[:3] if len(segment) in (2, 3) else (0,) * 3
            if size < 1 or taken < 0 or block < 1:
                raise ValueError(f"sampler state: bad segment {list(segment)} in 'segments'")
            segments.append((size, taken, block))
        self.epoch = int(state["epoch"])
        self._pending = segments
        self._active = None


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` into whole counts in proportion to ``weights`` (largest remainder:
    each count is within one of its exact share, and they add up to ``total``)."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda t: (counts[t] - exact[t], t))
    for t in by_remainder[: total - sum(counts)]:
        counts[t] += 1
    return counts
