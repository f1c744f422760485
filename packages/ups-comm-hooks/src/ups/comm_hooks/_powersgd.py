"""The ``powersgd`` and ``batched_powersgd`` hooks: PowerSGD, with a state that a checkpoint holds
and resumes, counting the bytes it sends, optionally in 16 bits.

``powersgd`` is torch's own ``powerSGD_hook``
(``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``): each gradient matrix of a bucket
compressed to rank ``r`` (P and Q), the others (biases, small matrices) all-reduced as they are.
``batched_powersgd`` is this module's implementation of torch's ``batched_powerSGD_hook``: the
whole bucket, padded with zeros, viewed as one square matrix and compressed to rank ``r``. torch's
own raises an ``AssertionError`` at its first compressing step in torch 2.13, on every backend
(its ``_orthogonalize`` takes batches of matrices since pytorch/pytorch#75157; the batched hook
hands it one matrix). Both all-reduce plainly for the first ``start_powersgd_iter`` iterations.

What this module adds is a state that can be saved (pytorch/pytorch#75666): torch's
``PowerSGDState`` keeps the iteration count, this rank's error feedback, the warm-start matrices P
and Q and the NumPy generator that seeds new Qs, and nothing saves them, so a resumed run starts
PowerSGD over (plain all-reduce again, then fresh Qs and no error feedback) and departs from the
run it continues. :class:`PowerSGDHookState` gives them as a ``state_dict`` of tensors and plain
values, and takes them back, before the first step, with ``load_state_dict``.

torch keys that state by bucket index, and a resumed DDP model's buckets are not laid out as the
saved ones in its first backward pass: DDP puts every parameter in one bucket, in the model's
order, and only after that pass rebuilds the buckets in the order the gradients became ready.
Applied as it is, the saved bucket 0's error feedback would be added to other parameters'
gradients (without an error where the lengths agree, as with a model in one bucket: the same
parameters, in the reverse order). So the state also records which parameters each bucket held
(``buckets``), and while a bucket is laid out otherwise, the algorithm runs on each saved bucket
it holds, cut out of it: the computation of the run that was saved, bitwise.

With ``wire_dtype``, as torch's ``bf16_compress_wrapper``/``fp16_compress_wrapper`` around the
hook (which DDP refuses without CUDA and NCCL): the bucket is cast to 16 bits, PowerSGD runs on
that copy (its error feedback, P and Q are 16-bit too), and the result is copied back. gloo sums
bfloat16 and float16 itself, so it works on CPU.
"""

# No `from __future__ import annotations` here: register_comm_hook checks the hook's
# annotations against the objects dist.GradBucket and torch.futures.Future[torch.Tensor].

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, cast

import attrs
import structlog
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    _orthogonalize as _orthogonalize_batch,
)
from torch.nn.parallel import DistributedDataParallel

from ups.core import ConfigError, RunContext, at_least

from ._traffic import HookOptions, Traffic, register

if TYPE_CHECKING:
    # torch.distributed re-exports it only when distributed is available: invisible to mypy.
    from torch._C._distributed_c10d import GradBucket
else:
    GradBucket = dist.GradBucket

log = structlog.get_logger()

_MEMORY = ("error_dict", "p_memory_dict", "q_memory_dict")
"""The per-bucket tensors of ``PowerSGDState``."""

_WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

_CHECKED_OPTIONS: dict[str, Any] = {
    "matrix_approximation_rank": None,
    "min_compression_rate": None,
    "batched": False,
    "wire_dtype": None,
}
"""The options a saved state must have been saved with (they decide its tensors' sizes, dtypes
and meaning), and what a state saved before the option existed had."""


def _below_2_to_the_32(_inst: object, _attr: "attrs.Attribute[int]", value: int) -> None:
    if value >= 2**32:
        raise ValueError("must be < 2**32 (it seeds a NumPy RandomState)")


@attrs.frozen(kw_only=True)
class PowerSGDOptions(HookOptions):
    """Options of the ``powersgd`` and ``batched_powersgd`` hooks: those of torch's
    ``PowerSGDState``, ``wire_dtype`` and ``profile``."""

    matrix_approximation_rank: int = attrs.field(default=2, validator=at_least(1))
    """The rank of the approximation of each gradient: lower compresses more, and loses more.
    torch advises rank 1 for ``batched_powersgd``: a bucket's parameters laid side by side in
    one matrix have no low-rank structure that a higher rank would find."""
    start_powersgd_iter: int = attrs.field(default=10, validator=at_least(2))
    """The iterations all-reduced plainly before PowerSGD starts. At least 2: DDP rebuilds its
    buckets after the first iteration, and the error feedback, the warm start and a saved state
    hold tensors laid out by bucket (torch requires 2 too, unless both are off)."""
    min_compression_rate: float = attrs.field(default=2.0, validator=at_least(0.0))
    """A gradient is compressed only when that divides its size by more than this; the others
    are all-reduced as they are. ``powersgd`` only: ``batched_powersgd`` compresses every
    bucket."""
    use_error_feedback: bool = True
    """Add what compression lost at the last step to this step's gradient (on each rank)."""
    warm_start: bool = True
    """Start each step from the last step's Q instead of a random one."""
    orthogonalization_epsilon: float = attrs.field(default=0.0, validator=at_least(0.0))
    """Added to the norms when orthogonalizing, against dividing by zero (say ``1e-8``)."""
    seed: int = attrs.field(default=0, validator=[at_least(0), _below_2_to_the_32])
    """Seeds the generator of the random Qs, the same on every rank."""
    wire_dtype: Literal["bf16", "fp16"] | None = None
    """Run PowerSGD on a bfloat16 or float16 copy of each bucket, so that P, Q and the gradients
    all-reduced as they are travel in 16 bits: half the bytes. ``None``: the gradients' dtype."""


class _SavedBucket:
    """A bucket's part, or a copy of it in another dtype: what the algorithms (torch's hook
    included) use of a ``GradBucket``."""

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


def _shape(parameter: torch.Tensor) -> torch.Size:
    """The shape the algorithms see ``parameter``'s gradient in: its own, but a scalar's is
    ``(1,)`` (torch's hook views each gradient as ``shape[0]`` rows: a scalar's has none)."""
    return parameter.shape if parameter.dim() else torch.Size([1])


def _orthogonalize(matrix: torch.Tensor, epsilon: float) -> None:
    """Orthonormalize the columns of ``matrix`` in place, as torch's hooks do (Gram-Schmidt
    below rank 3 and in 16 bits, QR otherwise)."""
    _orthogonalize_batch(matrix.unsqueeze(0), epsilon)  # type: ignore[no-untyped-call]


class PowerSGDHookState(Traffic):
    """The state the ``powersgd`` and ``batched_powersgd`` hooks are registered with: torch's
    ``PowerSGDState`` and the parameters each bucket held, which :meth:`state_dict` and
    :meth:`load_state_dict` save and restore; and, as every hook's, the bytes it hands to
    collectives (:class:`Traffic`).

    Bytes are counted per bucket, of the dtype sent (``wire_dtype``'s, or the gradients'). While
    all-reduced plainly, the bucket. Then, for ``powersgd``, the growth of torch's
    ``total_numel_after_compression`` across its hook, which counts exactly what it hands to its
    all-reduces: the uncompressed gradients, the Ps and the Qs; for ``batched_powersgd``, its P
    and Q (``side * rank`` each, side = ``ceil(sqrt(bucket length))``).

    Create it before ``ddp``'s first backward pass, as :func:`powersgd_compression` does.
    """

    def __init__(
        self, ddp: DistributedDataParallel, options: PowerSGDOptions, *, batched: bool = False
    ) -> None:
        super().__init__(ddp.process_group, profile=options.profile)
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
        """torch's state, which the algorithm reads and updates (``compression_stats()``
        tells how much it saves)."""
        self.batched = batched
        """Whether each bucket is compressed as one matrix (``batched_powersgd``)."""
        self.wire_dtype = options.wire_dtype
        """The dtype PowerSGD runs and sends in (``"bf16"``, ``"fp16"``), or ``None``."""
        self._dtype = None if options.wire_dtype is None else _WIRE_DTYPES[options.wire_dtype]
        self._algorithm: Callable[[GradBucket, int], torch.Tensor] = (
            self._batched_powersgd if batched else self._torch_powersgd
        )
        self._names = {id(p): name for name, p in ddp.module.named_parameters()}
        self._device = next(ddp.module.parameters()).device
        self._buckets: dict[int, tuple[str, ...]] = {}
        """The parameters (by name) of each bucket that the per-bucket tensors and the random
        draws are laid out for: the buckets of the last iteration that the algorithm ran on as
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
        the tensors' sizes and dtypes, ``matrix_approximation_rank``, ``min_compression_rate``,
        ``batched`` and ``wire_dtype``.
        """
        state = self.powersgd
        rng = state.rng.get_state(legacy=False)
        return {
            **self._checked_options(),
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

        :raises ValueError: when ``state`` was saved with another ``matrix_approximation_rank``,
            ``min_compression_rate`` or ``wire_dtype``, or by the other hook (``batched``).
        """
        for key, value in self._checked_options().items():
            saved = state.get(key, _CHECKED_OPTIONS[key])
            if saved != value:
                raise ValueError(
                    f"the PowerSGD state was saved with {key} {saved!r}, not {value!r} as now"
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

    def _checked_options(self) -> dict[str, Any]:
        return {
            "matrix_approximation_rank": self.powersgd.matrix_approximation_rank,
            "min_compression_rate": float(self.powersgd.min_compression_rate),
            "batched": self.batched,
            "wire_dtype": self.wire_dtype,
        }

    def communicate(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Run the algorithm on ``bucket`` (on its ``wire_dtype`` copy) or, once PowerSGD has
        started, on each saved bucket it holds when it is laid out otherwise than the state;
        return when it is done.

        Waiting keeps the ranks' collectives in one order: torch's hook issues its second and
        third all-reduce from callbacks, which gloo runs on its own threads, so with two buckets
        in flight ranks can issue them in different orders, and gloo aborts the process
        (pytorch/pytorch#58467).

        :raises RuntimeError: when ``bucket`` holds parts of saved buckets, not whole ones: the
            DDP model or its ``bucket_cap_mb`` are not those of the run that saved the state.
        """
        parameters = bucket.parameters()
        names = tuple(self._names[id(p)] for p in parameters)
        shapes = [_shape(p) for p in parameters]
        index = bucket.index()
        buffer = bucket.buffer()
        sent = buffer if self._dtype is None else buffer.to(self._dtype)
        started = self.powersgd.iter >= self.powersgd.start_powerSGD_iter
        if started and self._buckets and self._buckets.get(index) != names:
            gradients = dict(zip(names, _unflatten(sent, shapes), strict=True))
            self._communicate_saved_buckets(index, gradients)
            self._cut_this_iteration = True
        else:
            # Duck-typed: the algorithms call only index, buffer, gradients and is_last.
            whole = cast(GradBucket, _SavedBucket(index, sent, shapes, bucket.is_last()))
            result = self._algorithm(whole, index)
            if result is not sent:
                sent.copy_(result)
            self._seen[index] = names
        if sent is not buffer:
            buffer.copy_(sent)
        if bucket.is_last():
            if self._iterations > 0 and not self._cut_this_iteration:
                self._buckets = self._seen
            self._seen = {}
            self._cut_this_iteration = False
            self._iterations += 1
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    def _communicate_saved_buckets(self, index: int, gradients: dict[str, torch.Tensor]) -> None:
        """Run the algorithm on each saved bucket that bucket ``index``, whose ``gradients``
        these are, holds, in the order of their indices, and copy the results into them."""
        parts = [i for i, saved in sorted(self._buckets.items()) if set(saved) <= gradients.keys()]
        if {name for i in parts for name in self._buckets[i]} != gradients.keys():
            raise RuntimeError(
                f"powersgd: bucket {index} of this DDP model holds the parameters"
                f" {list(gradients)}, which are not whole buckets of those the PowerSGD state was"
                f" saved for: {sorted(self._buckets.items())}. Resume with the model and the DDP"
                " options (bucket_cap_mb) of the run that saved it."
            )
        last = max(self._buckets)
        for i in parts:
            saved = self._buckets[i]
            shapes = [gradients[name].shape for name in saved]
            flat = torch.cat([gradients[name].reshape(-1) for name in saved])
            cut = cast(GradBucket, _SavedBucket(i, flat, shapes, is_last=i == last))
            result = self._algorithm(cut, index)
            for name, part in zip(saved, _unflatten(result, shapes), strict=True):
                gradients[name].copy_(part)

    def _torch_powersgd(self, bucket: GradBucket, counted_as: int) -> torch.Tensor:
        """``powersgd``'s algorithm: torch's ``powerSGD_hook`` on ``bucket``, waited for; its
        bytes counted for bucket ``counted_as``."""
        state = self.powersgd
        plain = state.iter < state.start_powerSGD_iter
        before = state.total_numel_after_compression
        result = powerSGD_hook(state, bucket).wait()
        buffer = bucket.buffer()
        after = state.total_numel_after_compression
        self.count(counted_as, buffer, buffer.numel() if plain else after - before)
        return result

    def _batched_powersgd(self, bucket: GradBucket, counted_as: int) -> torch.Tensor:
        """``batched_powersgd``'s algorithm, that of torch's ``batched_powerSGD_hook``, on
        ``bucket``, in place; its bytes counted for bucket ``counted_as``.

        The bucket, padded with zeros to ``side²`` (``side = ceil(sqrt(length))``), plus the
        error feedback, is a matrix M; P = MQ is all-reduced and orthogonalized, Q = MᵀP is
        all-reduced and divided by the world size, and M ≈ PQᵀ. The error feedback, P and Q
        are of the padded size. Unlike torch's, it pads a copy (torch resizes the bucket's own
        buffer), the rank is at most ``side``, and P is orthogonalized with
        ``orthogonalization_epsilon`` too.
        """
        state = self.powersgd
        buffer = bucket.buffer()
        if state.iter < state.start_powerSGD_iter:
            state.maybe_increase_iter(bucket)  # type: ignore[no-untyped-call]
            return self.all_reduce(buffer.div_(self.world_size), counted_as).wait()
        index = bucket.index()
        length = buffer.numel()
        side = math.ceil(math.sqrt(length))
        rank = min(side, state.matrix_approximation_rank)
        state.total_numel_before_compression += length
        state.total_numel_after_compression += 2 * side * rank
        padded = buffer.new_zeros(side * side)
        padded[:length] = buffer
        if state.use_error_feedback and index in state.error_dict:
            padded.add_(state.error_dict[index])
        compensated = padded.clone() if state.use_error_feedback else padded
        matrix = padded.view(side, side)
        if not state.warm_start or index not in state.p_memory_dict:
            with torch.random.fork_rng(devices=[]):  # the same draws on every rank
                torch.manual_seed(state.rng.randint(1_000_000_000))
                q = torch.randn(side, rank, dtype=buffer.dtype)
            state.q_memory_dict[index] = q.to(buffer.device)
            state.p_memory_dict[index] = buffer.new_empty(side, rank)
        p, q = state.p_memory_dict[index], state.q_memory_dict[index]
        epsilon = state.orthogonalization_epsilon
        _orthogonalize(q, epsilon)
        torch.matmul(matrix, q, out=p)
        self.all_reduce(p, counted_as).wait()
        _orthogonalize(p, epsilon)
        torch.matmul(matrix.t(), p, out=q)
        self.all_reduce(q, counted_as).wait()
        q.div_(self.world_size)
        torch.matmul(p, q.t(), out=matrix)
        if state.use_error_feedback:
            state.error_dict[index] = compensated - padded
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        state.maybe_increase_iter(bucket)  # type: ignore[no-untyped-call]
        return buffer.copy_(padded[:length])


def powersgd_hook(
    state: PowerSGDHookState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The hook :func:`powersgd_compression` and :func:`batched_powersgd_compression` register:
    :meth:`PowerSGDHookState.communicate`."""
    return state.communicate(bucket)


def _compressed(parameter: torch.Tensor, options: PowerSGDOptions) -> bool:
    """Whether torch's ``powerSGD_hook`` compresses ``parameter``'s gradient (its
    ``_should_compress``)."""
    shape = _shape(parameter)
    rows = shape[0]
    columns = shape.numel() // rows if rows else 0
    rank = min(rows, columns, options.matrix_approximation_rank)
    return (rows + columns) * rank * options.min_compression_rate < rows * columns


def _register(
    ddp: DistributedDataParallel, ctx: RunContext, options: PowerSGDOptions, *, batched: bool
) -> PowerSGDHookState:
    """Check ``ddp``'s model for what PowerSGD cannot do, warn (on rank 0) of what it does
    badly, register :func:`powersgd_hook` and return its state."""
    name = "batched_powersgd" if batched else "powersgd"
    sparse = [
        module_name
        for module_name, module in ddp.module.named_modules()
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.sparse
    ]
    if sparse:
        # torch's hook is handed the sparse gradient as a bucket, and the ranks' collectives
        # stop matching: gloo times out (checked on torch 2.13).
        raise ConfigError(
            "comm_hook.name",
            f"{name} cannot compress sparse gradients, which {sparse} (sparse=True) have: use"
            " allreduce, or sparse=False",
        )
    trained = [p for p in ddp.module.parameters() if p.requires_grad]
    if ctx.rank == 0:
        if batched and options.min_compression_rate != PowerSGDOptions().min_compression_rate:
            log.warning(
                f"comm_hook {name}: min_compression_rate is ignored; every bucket is compressed",
                min_compression_rate=options.min_compression_rate,
            )
        if not batched and not any(_compressed(p, options) for p in trained):
            log.warning(
                f"comm_hook {name}: no gradient of this model is compressed (all are vectors, or"
                " too small for matrix_approximation_rank and min_compression_rate): every"
                " bucket is all-reduced as it is, after a copy; use allreduce (or bf16)",
                matrix_approximation_rank=options.matrix_approximation_rank,
                min_compression_rate=options.min_compression_rate,
            )
        wire = None if options.wire_dtype is None else _WIRE_DTYPES[options.wire_dtype]
        if wire is not None and {p.dtype for p in trained} == {wire}:
            log.warning(
                f"comm_hook {name}: the gradients are {wire} already, so wire_dtype"
                f" {options.wire_dtype} changes nothing; leave it out",
            )
    state = PowerSGDHookState(ddp, options, batched=batched)
    return register(ddp, state, powersgd_hook)


def powersgd_compression(
    ddp: DistributedDataParallel, *, ctx: RunContext, options: PowerSGDOptions
) -> PowerSGDHookState:
    """The ``powersgd`` plugin's factory: register :func:`powersgd_hook` on ``ddp`` (before its
    first backward pass), running torch's ``powerSGD_hook``, and return its state.

    :param ctx: its rank decides who warns: the hook communicates over ``ddp``'s process group.
    :raises ConfigError: when the model has sparse gradients (``nn.Embedding(sparse=True)``).
    """
    return _register(ddp, ctx, options, batched=False)


def batched_powersgd_compression(
    ddp: DistributedDataParallel, *, ctx: RunContext, options: PowerSGDOptions
) -> PowerSGDHookState:
    """The ``batched_powersgd`` plugin's factory: register :func:`powersgd_hook` on ``ddp``
    (before its first backward pass), compressing each bucket as one matrix, as torch's
    ``batched_powerSGD_hook`` would, and return its state.

    :param ctx: its rank decides who warns: the hook communicates over ``ddp``'s process group.
    :raises ConfigError: when the model has sparse gradients (``nn.Embedding(sparse=True)``).
    """
    return _register(ddp, ctx, options, batched=True)
