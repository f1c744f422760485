"""The ``powersgd`` hook: torch's PowerSGD, with a state that a checkpoint holds and resumes.

The algorithm is torch's own ``powerSGD_hook``
(``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``). What this module adds is a
state that can be saved (pytorch/pytorch#75666): torch's ``PowerSGDState`` keeps the iteration
count, this rank's error feedback, the warm-start matrices P and Q and the NumPy generator that
seeds new Qs, and nothing saves them, so a resumed run starts PowerSGD over (plain all-reduce
again, then fresh Qs and no error feedback) and departs from the run it continues.
:class:`PowerSGDHookState` gives them as a ``state_dict`` of tensors and plain values, and takes
them back, before the first step, with ``load_state_dict``.

torch keys that state by bucket index, and a resumed DDP model's buckets are not laid out as the
saved ones in its first backward pass: DDP puts every parameter in one bucket, in the model's
order, and only after that pass rebuilds the buckets in the order the gradients became ready.
Applied as it is, the saved bucket 0's error feedback would be added to other parameters'
gradients (without an error where the lengths agree, as with a model in one bucket: the same
parameters, in the reverse order). So the state also records which parameters each bucket held
(``buckets``), and while a bucket is laid out otherwise, torch's hook runs on each saved bucket it
holds, cut out of it: the computation of the run that was saved, bitwise.

torch's other hook, ``batched_powerSGD_hook``, is not offered: in torch 2.13 it raises an
``AssertionError`` at its first compressing step, on every backend (its ``_orthogonalize`` takes
batches of matrices since pytorch/pytorch#75157; the batched hook hands it one matrix).
"""

# No `from __future__ import annotations` here: register_comm_hook checks the hook's
# annotations against the objects dist.GradBucket and torch.futures.Future[torch.Tensor].

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import attrs
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel

from ups.core import RunContext, at_least

if TYPE_CHECKING:
    # torch.distributed re-exports it only when distributed is available: invisible to mypy.
    from torch._C._distributed_c10d import GradBucket
else:
    GradBucket = dist.GradBucket

_MEMORY = ("error_dict", "p_memory_dict", "q_memory_dict")
"""The per-bucket tensors of ``PowerSGDState``."""


def _below_2_to_the_32(_inst: object, _attr: "attrs.Attribute[int]", value: int) -> None:
    if value >= 2**32:
        raise ValueError("must be < 2**32 (it seeds a NumPy RandomState)")


@attrs.frozen(kw_only=True)
class PowerSGDOptions:
    """Options of the ``powersgd`` hook: those of torch's ``PowerSGDState``."""

    matrix_approximation_rank: int = attrs.field(default=2, validator=at_least(1))
    """The rank of the approximation of each gradient: lower compresses more, and loses more."""
    start_powersgd_iter: int = attrs.field(default=10, validator=at_least(2))
    """The iterations all-reduced plainly before PowerSGD starts. At least 2: DDP rebuilds its
    buckets after the first iteration, and the error feedback, the warm start and a saved state
    hold tensors laid out by bucket (torch requires 2 too, unless both are off)."""
    min_compression_rate: float = attrs.field(default=2.0, validator=at_least(0.0))
    """A gradient is compressed only when that divides its size by more than this; the others
    are all-reduced as they are."""
    use_error_feedback: bool = True
    """Add what compression lost at the last step to this step's gradient (on each rank)."""
    warm_start: bool = True
    """Start each step from the last step's Q instead of a random one."""
    orthogonalization_epsilon: float = attrs.field(default=0.0, validator=at_least(0.0))
    """Added to the norms when orthogonalizing, against dividing by zero (say ``1e-8``)."""
    seed: int = attrs.field(default=0, validator=[at_least(0), _below_2_to_the_32])
    """Seeds the generator of the random Qs, the same on every rank."""


class _SavedBucket:
    """A bucket of the saved run, cut out of a bucket of this one: what torch's hook uses of a
    ``GradBucket``."""

    def __init__(
        self, index: int, buffer: torch.Tensor, shapes: list[torch.Size], is_last: bool
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._shapes = shapes
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return _unflatten(self._buffer, self._shapes)

    def is_last(self) -> bool:
        return self._is_last


def _unflatten(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Views of ``flat``, one after the other, of ``shapes``."""
    sizes = [shape.numel() for shape in shapes]
    return [
        part.view(shape) for part, shape in zip(flat.split_with_sizes(sizes), shapes, strict=True)
    ]


class PowerSGDHookState:
    """The state the ``powersgd`` hook is registered with: torch's ``PowerSGDState``, and the
    parameters each bucket held; :meth:`state_dict` and :meth:`load_state_dict` save and restore
    them.

    Create it before ``ddp``'s first backward pass, as :func:`powersgd_compression` does.
    """

    def __init__(self, ddp: DistributedDataParallel, options: PowerSGDOptions) -> None:
        self.powersgd = PowerSGDState(
            process_group=ddp.process_group,
            matrix_approximation_rank=options.matrix_approximation_rank,
            start_powerSGD_iter=options.start_powersgd_iter,
            min_compression_rate=options.min_compression_rate,
            use_error_feedback=options.use_error_feedback,
            warm_start=options.warm_start,
            orthogonalization_epsilon=options.orthogonalization_epsilon,
            random_seed=options.seed,
        )
        """torch's state, which ``powerSGD_hook`` reads and updates (``compression_stats()``
        tells how much it saves)."""
        self._names = {id(p): name for name, p in ddp.module.named_parameters()}
        self._device = next(ddp.module.parameters()).device
        self._buckets: dict[int, tuple[str, ...]] = {}
        """The parameters (by name) of each bucket that the per-bucket tensors and the random
        draws are laid out for: the buckets of the last iteration that torch's hook ran on as
        they were, but the first (whose buckets DDP rebuilds)."""
        self._seen: dict[int, tuple[str, ...]] = {}
        self._cut_this_iteration = False
        self._iterations = 0

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (the error feedback is the rank's own): tensors, copied to the CPU,
        numbers, strings, and lists and dicts of them, which ``torch.load(..., weights_only=True)``
        reads back.

        Keys: ``iter``; ``error_dict``, ``p_memory_dict`` and ``q_memory_dict`` (bucket index to
        tensor); ``buckets`` (bucket index to its parameters' names); ``rng`` (the MT19937 state
        of the generator that seeds Qs); the compression statistics; and the options that decide
        the tensors' sizes, ``matrix_approximation_rank`` and ``min_compression_rate``.
        """
        state = self.powersgd
        rng = state.rng.get_state(legacy=False)
        return {
            **self._sizing_options(),
            "iter": state.iter,
            "rng": {  # MT19937's 624 32-bit words, the position in them, a cached normal
                "key": torch.tensor(rng["state"]["key"].tolist(), dtype=torch.int64),
                "pos": int(rng["state"]["pos"]),
                "has_gauss": int(rng["has_gauss"]),
                "gauss": float(rng["gauss"]),
            },
            **{
                name: {i: t.detach().to("cpu", copy=True) for i, t in getattr(state, name).items()}
                for name in _MEMORY
            },
            "buckets": {i: list(names) for i, names in self._buckets.items()},
            "total_numel_before_compression": state.total_numel_before_compression,
            "total_numel_after_compression": state.total_numel_after_compression,
            "next_stats_report": state.next_stats_report,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``, what :meth:`state_dict` returned on this rank; the tensors
        are copied to the device of the model's parameters.

        :raises ValueError: when ``state`` was saved with another ``matrix_approximation_rank``
            or ``min_compression_rate``.
        """
        for key, value in self._sizing_options().items():
            if state[key] != value:
                raise ValueError(
                    f"the PowerSGD state was saved with {key} {state[key]!r}, not {value!r} as now"
                )
        torch_state = self.powersgd
        rng = state["rng"]
        torch_state.rng.set_state(
            {
                "bit_generator": "MT19937",
                "state": {"key": rng["key"].numpy().astype("uint32"), "pos": rng["pos"]},
                "has_gauss": rng["has_gauss"],
                "gauss": rng["gauss"],
            }
        )
        for name in _MEMORY:
            memory = {int(i): t.to(self._device, copy=True) for i, t in state[name].items()}
            setattr(torch_state, name, memory)
        torch_state.iter = state["iter"]
        torch_state.total_numel_before_compression = state["total_numel_before_compression"]
        torch_state.total_numel_after_compression = state["total_numel_after_compression"]
        torch_state.next_stats_report = state["next_stats_report"]
        self._buckets = {int(i): tuple(names) for i, names in state["buckets"].items()}

    def _sizing_options(self) -> dict[str, Any]:
        return {
            "matrix_approximation_rank": self.powersgd.matrix_approximation_rank,
            "min_compression_rate": float(self.powersgd.min_compression_rate),
        }

    def communicate(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Run torch's hook on ``bucket`` or, once PowerSGD has started, on each saved bucket it
        holds when it is laid out otherwise than the state; return when it is done.

        Waiting for torch's hook keeps the ranks' collectives in one order: it issues its second
        and third all-reduce from callbacks, which gloo runs on its own threads, so with two
        buckets in flight ranks can issue them in different orders, and gloo aborts the process
        (pytorch/pytorch#58467).

        :raises RuntimeError: when ``bucket`` holds parts of saved buckets, not whole ones: the
            DDP model or its ``bucket_cap_mb`` are not those of the run that saved the state.
        """
        names = tuple(self._names[id(p)] for p in bucket.parameters())
        index = bucket.index()
        started = self.powersgd.iter >= self.powersgd.start_powerSGD_iter
        if started and self._buckets and self._buckets.get(index) != names:
            self._communicate_saved_buckets(bucket, names)
            result = bucket.buffer()
            self._cut_this_iteration = True
        else:
            result = powerSGD_hook(self.powersgd, bucket).wait()
            self._seen[index] = names
        if bucket.is_last():
            if self._iterations > 0 and not self._cut_this_iteration:
                self._buckets = self._seen
            self._seen = {}
            self._cut_this_iteration = False
            self._iterations += 1
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(result)
        return done

    def _communicate_saved_buckets(self, bucket: GradBucket, names: tuple[str, ...]) -> None:
        """Run torch's hook on each saved bucket that ``bucket`` holds, in the order of their
        indices, and copy the results into ``bucket``."""
        gradients = dict(zip(names, bucket.gradients(), strict=True))
        parts = [i for i, saved in sorted(self._buckets.items()) if set(saved) <= gradients.keys()]
        if {name for i in parts for name in self._buckets[i]} != gradients.keys():
            raise RuntimeError(
                f"powersgd: bucket {bucket.index()} of this DDP model holds the parameters"
                f" {list(names)}, which are not whole buckets of those the PowerSGD state was"
                f" saved for: {sorted(self._buckets.items())}. Resume with the model and the DDP"
                " options (bucket_cap_mb) of the run that saved it."
            )
        last = max(self._buckets)
        for i in parts:
            saved = self._buckets[i]
            shapes = [gradients[name].shape for name in saved]
            flat = torch.cat([gradients[name].reshape(-1) for name in saved])
            # Duck-typed: powerSGD_hook calls only index, buffer, gradients and is_last.
            cut = cast(GradBucket, _SavedBucket(i, flat, shapes, is_last=i == last))
            result = powerSGD_hook(self.powersgd, cut).wait()
            for name, part in zip(saved, _unflatten(result, shapes), strict=True):
                gradients[name].copy_(part)


def powersgd_hook(
    state: PowerSGDHookState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The hook :func:`powersgd_compression` registers: :meth:`PowerSGDHookState.communicate`."""
    return state.communicate(bucket)


def powersgd_compression(
    ddp: DistributedDataParallel, *, ctx: RunContext, options: PowerSGDOptions
) -> PowerSGDHookState:
    """The ``powersgd`` plugin's factory: register :func:`powersgd_hook` on ``ddp`` (before its
    first backward pass) and return its state.

    :param ctx: unused: the hook communicates over ``ddp``'s process group.
    """
    state = PowerSGDHookState(ddp, options)
    ddp.register_comm_hook(state, powersgd_hook)
    return state
