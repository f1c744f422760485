"""The ``topk`` hook: each rank sends only the largest entries of its gradients, and keeps what it
did not send for the next step (error feedback).

For each parameter, a rank adds its error feedback to the gradient and picks the
``k = max(1, ceil(ratio * numel))`` entries of largest magnitude; what it does not send becomes
its new error feedback (Stich et al., "Sparsified SGD with memory", 2018). The selection is per
parameter, not per bucket, so it does not depend on how DDP lays out its buckets (it puts every
parameter in one bucket in the first backward pass and rebuilds them after; a resumed run's first
step has the first layout again): the error feedback is kept by parameter name, and a run resumed
from :meth:`TopKState.state_dict` goes on bitwise as the run it continues.

What crosses the wire, per bucket and per rank: one ``uint8`` tensor holding the ``sum(k)``
selected values, in the gradients' dtype, and their positions in the bucket (``int32``, or
``int64`` for a bucket of ``2**31`` elements or more), which is all-gathered. Each rank then
adds every rank's values into a zero bucket, rank after rank, in rank order, and divides by the
world size, so every rank computes the same bits. For ``float16`` and ``bfloat16`` gradients the
sums, the division and the error feedback are in ``float32``; the result is rounded once.

Bytes: a rank hands ``sum(k) * (value bytes + index bytes)`` per step to the all-gather, about
``2 * ratio`` of plain all-reduce for ``float32`` (``3 * ratio`` for 16-bit gradients), which is
what the engine's ``comm_ratio`` reports. But an all-gather brings each rank every other rank's
share: ``(world_size - 1)`` times that crosses each rank's link, against about twice the bucket
for a ring all-reduce. Top-k moves fewer bytes over the links only while ``world_size * sent <
2 * all-reduce bytes``, about ``world_size < 1 / ratio`` for ``float32`` gradients; the factory
warns (rank 0) when the model is past that, and when ``ratio`` is 1 (every value, and an index
for each, is sent).

The hook is synchronous: it returns once the bucket is averaged (callbacks on gloo's threads can
issue collectives in different orders on different ranks, pytorch/pytorch#58467), so a bucket's
communication does not overlap the rest of the backward pass as DDP's own does.

A bucket whose average is not finite (an overflowing ``float16`` step, which a ``GradScaler``
skips) leaves its parameters' error feedback as it was, instead of keeping ``inf`` or ``NaN``
in it for good. Under a ``GradScaler`` the error feedback is in the units of the loss scale of
the step that kept it; when the scaler changes the scale, what is carried over is off by that
factor until it is sent.
"""

# No `from __future__ import annotations` here: register_comm_hook checks the hook's
# annotations against the objects dist.GradBucket and torch.futures.Future[torch.Tensor].

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import attrs
import structlog
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ups.core import RunContext, above, at_least

from ._traffic import HookOptions, Traffic, register

if TYPE_CHECKING:
    # torch.distributed re-exports it only when distributed is available: invisible to mypy.
    from torch._C._distributed_c10d import GradBucket
else:
    GradBucket = dist.GradBucket

log = structlog.get_logger()


def _at_most_one(_inst: object, _attr: "attrs.Attribute[float]", value: float) -> None:
    if value > 1:
        raise ValueError("must be <= 1")


@attrs.frozen(kw_only=True)
class TopKOptions(HookOptions):
    """Options of the ``topk`` hook."""

    ratio: float = attrs.field(default=0.01, validator=[above(0.0), _at_most_one])
    """The share of each parameter's entries a rank sends per step: ``k = max(1, ceil(ratio *
    numel))`` of them (``ratio`` taken as the decimal written: 0.07 of 100 is 7)."""
    start_iter: int = attrs.field(default=10, validator=at_least(0))
    """The iterations all-reduced plainly (as DDP does) before top-k starts: the first
    gradients are the largest and change fastest, and the error feedback would carry them
    stale into later steps (the warm-up of Lin et al., "Deep Gradient Compression", 2018). As
    PowerSGD's default; 0 is allowed, since the selection does not depend on DDP's buckets."""


def top_k_count(numel: int, ratio: float) -> int:
    """How many of a parameter's ``numel`` entries are sent: ``max(1, ceil(ratio * numel))``,
    at most ``numel``. ``ratio`` is taken as its shortest decimal (``repr``), so that 0.07 of 100
    is 7, not the 8 that the binary 0.07000000000000000666 would give."""
    wanted = math.ceil(Fraction(repr(ratio)) * numel)
    return min(numel, max(1, wanted))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and error feedback are kept in for gradients of ``dtype``: at least
    ``float32``."""
    return torch.promote_types(dtype, torch.float32)


@attrs.frozen
class SparseLayout:
    """How one bucket's gradients are sparsified, packed and averaged: the pure computation of
    the ``topk`` hook, which only the all-gather is missing from.

    Values travel in :attr:`dtype`; indices are positions in the bucket (the parameters' flat
    gradients one after the other).
    """

    numels: tuple[int, ...]
    """The number of entries of each parameter of the bucket, in the bucket's order."""
    ks: tuple[int, ...]
    """How many entries of each parameter are sent."""
    dtype: torch.dtype
    """The gradients' dtype, in which the selected values travel."""
    index_dtype: torch.dtype
    """``int32`` or ``int64``: the dtype positions travel in."""

    @classmethod
    def of(
        cls,
        numels: Sequence[int],
        ks: Sequence[int],
        dtype: torch.dtype,
        index_dtype: torch.dtype | None = None,
    ) -> "SparseLayout":
        """The layout of a bucket; positions in ``int32`` when it has fewer than ``2**31``
        entries (and ``index_dtype`` is not given), else ``int64``."""
        if index_dtype is None:
            index_dtype = torch.int32 if sum(numels) < 2**31 else torch.int64
        return cls(tuple(numels), tuple(ks), dtype, index_dtype)

    @property
    def numel(self) -> int:
        """The number of entries of the bucket."""
        return sum(self.numels)

    @property
    def count(self) -> int:
        """The number of entries a rank sends."""
        return sum(self.ks)

    @property
    def nbytes(self) -> int:
        """The bytes a rank hands to the all-gather: its values and their positions."""
        return self.count * (self.dtype.itemsize + self.index_dtype.itemsize)

    def encode(
        self, gradients: Sequence[torch.Tensor], errors: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Select each parameter's ``k`` entries of largest magnitude in ``gradient + error``
        (in :func:`accumulation_dtype`); return them packed (what this rank sends) and, per
        parameter, what was not sent: ``gradient + error - sent``, exactly (the new error
        feedback, flat). Neither argument is changed."""
        accumulate = accumulation_dtype(self.dtype)
        values, indices, new_errors = [], [], []
        offset = 0
        for gradient, error, numel, k in zip(gradients, errors, self.numels, self.ks, strict=True):
            corrected = gradient.reshape(-1).to(accumulate) + error.reshape(-1)
            if k == numel:
                chosen = torch.arange(numel, device=corrected.device)
            else:
                chosen = torch.topk(corrected.abs(), k, sorted=False).indices
            picked = corrected[chosen]
            sent = picked.to(self.dtype)
            # The rounding of `picked` to `sent` is within a factor 2 of it: the difference is
            # exact, and so is adding it back to what was sent.
            corrected[chosen] = picked - sent.to(accumulate)
            values.append(sent)
            indices.append(chosen + offset)
            new_errors.append(corrected)
            offset += numel
        return self._pack(torch.cat(values), torch.cat(indices).to(self.index_dtype)), new_errors

    def _order(self) -> list[torch.dtype]:
        # The larger elements first, so that the second part starts aligned for its dtype.
        return sorted((self.dtype, self.index_dtype), key=lambda d: -d.itemsize)

    def _pack(self, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        parts = {self.dtype: values, self.index_dtype: indices}
        return torch.cat([parts[dtype].view(torch.uint8) for dtype in self._order()])

    def decode(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The values and positions one rank sent (``packed``, from :meth:`encode`)."""
        first, second = self._order()
        split = self.count * first.itemsize
        parts = {first: packed[:split].view(first), second: packed[split:].view(second)}
        return parts[self.dtype], parts[self.index_dtype]

    def average(self, gathered: Sequence[torch.Tensor]) -> torch.Tensor:
        """The mean over the ranks of what each sent (``gathered``, in rank order), flat, in
        :func:`accumulation_dtype`: zeros, plus each rank's values at their positions, rank
        after rank, divided by the number of ranks. Every entry gets the same additions in the
        same order whatever the bucket's layout, so the result is the same to the bit on every
        rank and in every layout."""
        accumulate = accumulation_dtype(self.dtype)
        total = torch.zeros(self.numel, dtype=accumulate, device=gathered[0].device)
        for packed in gathered:
            values, indices = self.decode(packed)
            # Positions are distinct within a rank: one addition per entry, in rank order.
            total.index_add_(0, indices, values.to(accumulate))
        return total.div_(len(gathered))


class TopKState(Traffic):
    """The state the ``topk`` hook is registered with: the options, the iteration count and each
    parameter's error feedback, which :meth:`state_dict` and :meth:`load_state_dict` save and
    restore."""

    def __init__(self, ddp: DistributedDataParallel, options: TopKOptions) -> None:
        super().__init__(ddp.process_group, profile=options.profile)
        self.ratio = options.ratio
        """The share of each parameter's entries sent per step."""
        self.start_iter = options.start_iter
        """The iterations all-reduced plainly first."""
        self.iter = 0
        """The iterations (backward passes that reached DDP's last bucket) so far."""
        trained = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad]
        self._names = {id(p): name for name, p in trained}
        self._k = {name: top_k_count(p.numel(), self.ratio) for name, p in trained}
        self._shape = {
            name: (p.numel(), accumulation_dtype(p.dtype), p.device) for name, p in trained
        }
        self._errors: dict[str, torch.Tensor] = {}
        index_bytes = 4 if sum(p.numel() for _, p in trained) < 2**31 else 8
        self.dense_bytes = sum(p.numel() * p.element_size() for _, p in trained)
        """The bytes plain all-reduce hands to collectives per step (per rank)."""
        self.sparse_bytes = sum(self._k[n] * (p.element_size() + index_bytes) for n, p in trained)
        """The bytes this hook hands to collectives per step (per rank), once top-k has
        started."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: ``iter``, ``ratio`` (for information) and ``errors``, each
        parameter's error feedback by name (flat, copied to the CPU), which
        ``torch.load(..., weights_only=True)`` reads back."""
        return {
            "iter": self.iter,
            "ratio": self.ratio,
            "errors": {n: t.detach().to("cpu", copy=True) for n, t in self._errors.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``, what :meth:`state_dict` returned on this rank (before the
        first step); the error feedback is copied to its parameter's device.

        :raises ValueError: when ``state`` holds error feedback for a parameter the model does
            not train, or of another size.
        """
        errors: dict[str, torch.Tensor] = {}
        for name, error in state["errors"].items():
            if name not in self._shape:
                raise ValueError(
                    f"the top-k state holds error feedback for {name!r}, which this model does"
                    f" not train (it trains {sorted(self._shape)})"
                )
            numel, dtype, device = self._shape[name]
            if error.numel() != numel:
                raise ValueError(
                    f"the top-k state holds {error.numel()} entries of error feedback for"
                    f" {name!r}, which has {numel}"
                )
            errors[name] = error.to(device, dtype, copy=True).reshape(-1)
        self._errors = errors
        self.iter = int(state["iter"])

    def communicate(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Average ``bucket`` over the group: all-reduced before :attr:`start_iter`, top-k
        after (returning when it is done)."""
        buffer = bucket.buffer()
        index = bucket.index()
        if self.iter < self.start_iter:
            buffer.div_(self.world_size)
            future = self.all_reduce(buffer, index)
        else:
            self._sparse_average(bucket, buffer)
            future = torch.futures.Future()
            future.set_result(buffer)
        if bucket.is_last():
            self.iter += 1
        return future

    def _sparse_average(self, bucket: GradBucket, buffer: torch.Tensor) -> None:
        names = [self._names[id(p)] for p in bucket.parameters()]
        numels = [self._shape[name][0] for name in names]
        if sum(numels) != buffer.numel():
            raise RuntimeError(
                f"topk: bucket {bucket.index()} holds {buffer.numel()} entries, not the"
                f" {sum(numels)} of its parameters {names} (sparse gradients are not supported)"
            )
        layout = SparseLayout.of(numels, [self._k[name] for name in names], buffer.dtype)
        errors = [self._error(name) for name in names]
        packed, new_errors = layout.encode(buffer.split_with_sizes(numels), errors)
        mean = layout.average(self.all_gather(packed, bucket.index()))
        # Every rank has the same mean, so every rank decides alike.
        finite = torch.isfinite(mean).all()
        for name, old, new in zip(names, errors, new_errors, strict=True):
            self._errors[name] = torch.where(finite, new, old)
        buffer.copy_(mean)

    def _error(self, name: str) -> torch.Tensor:
        error = self._errors.get(name)
        if error is None:
            numel, dtype, device = self._shape[name]
            error = self._errors[name] = torch.zeros(numel, dtype=dtype, device=device)
        return error


def topk_hook(state: TopKState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The hook :func:`topk_compression` registers: :meth:`TopKState.communicate`."""
    return state.communicate(bucket)


def topk_compression(
    ddp: DistributedDataParallel, *, ctx: RunContext, options: TopKOptions
) -> TopKState:
    """The ``topk`` plugin's factory: register :func:`topk_hook` on ``ddp`` (timed when
    ``options.profile``) and return its state.

    Warns on rank 0 when ``ratio`` is 1, and when the all-gather brings each rank at least as
    many bytes as a ring all-reduce would (``world_size * sparse_bytes >= 2 * dense_bytes``).
    """
    state = TopKState(ddp, options)
    world_size = state.world_size
    if ctx.rank == 0:
        if options.ratio == 1:
            log.warning(
                "comm_hook topk: ratio 1 sends every value and an index for each: more bytes"
                " than allreduce",
                sparse_bytes=state.sparse_bytes,
                dense_bytes=state.dense_bytes,
            )
        elif world_size * state.sparse_bytes >= 2 * state.dense_bytes:
            log.warning(
                "comm_hook topk: the all-gather brings each rank world_size - 1 times what a rank"
                " sends, at least as many bytes as a ring all-reduce of the gradients; lower the"
                " ratio or use allreduce",
                world_size=world_size,
                ratio=options.ratio,
                sparse_bytes=state.sparse_bytes,
                dense_bytes=state.dense_bytes,
            )
    return register(ddp, state, topk_hook)
