"""An exponential moving average (EMA) of a model's weights, for the run (``training.ema``) and
for a loop of one's own.

The averages are kept beside the model, in fp32 (or the tensor's own dtype where it is wider),
on the model's device, and updated with one ``torch._foreach_lerp_`` per dtype after an
optimizer step (as ``torch.optim.swa_utils.get_ema_multi_avg_fn`` does), never a Python loop
over the tensors. Under DDP every rank holds the same parameters after a step, so every rank's
EMA is the same without any communication. Buffers are averaged too where they are floating
point or complex (BatchNorm's running statistics, as ``AveragedModel(use_buffers=True)`` and timm's
``ModelEmaV3`` do), and copied where they are not (``num_batches_tracked``); a buffer that
differs between ranks (BatchNorm without ``sync_batchnorm`` updates its statistics on each
rank's own batches) gives a per-rank average of it, as the model's own buffer is per rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

Evaluate = Literal["both", "ema", "live"]
"""Which weights an evaluation measures: ``both`` (the live weights' metrics under their own
names, the EMA's beside them with an ``_ema`` suffix), ``ema`` (the EMA's only, under the
plain names) or ``live`` (the live weights' only)."""

WARMUP_UPDATES = 10
"""With ``warmup``, the decay of the ``n``-th update is ``min(decay, (1 + n) / (10 + n))``
(TensorFlow's ``ExponentialMovingAverage`` with ``num_updates``): early averages forget the
random initial weights quickly."""


class EMA:
    """The exponential moving average of ``model``'s parameters and floating-point buffers:
    after optimizer step ``step``, :meth:`update` sets ``ema = decay * ema + (1 - decay) * live``.

    :param decay: the weight of the old average at each update, in ``(0, 1)``.
    :param every_steps: update at every this many steps after ``start_step``.
    :param start_step: until this step, the average is a copy of the live weights; it starts
        averaging from the weights of this step on.
    :param warmup: the decay of the ``n``-th update is ``min(decay, (1 + n) / (10 + n))``.
    :raises ValueError: for an argument outside these ranges.

    Build it once the model is on its device (the averages are kept where its tensors are), and
    pass the bare model, not its DDP wrapper. In a loop of one's own::

        ema = EMA(model, decay=0.999)
        for step, batch in enumerate(batches, start=1):
            ...  # forward, backward, optimizer.step()
            ema.update(step)
        with ema.applied():  # the model holds the averages, then its own weights again
            evaluate(model)
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.999,
        *,
        every_steps: int = 1,
        start_step: int = 0,
        warmup: bool = False,
    ) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), e.g. 0.999; got {decay!r}")
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1; got {every_steps!r}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0; got {start_step!r}")
        self.decay, self.every_steps, self.start_step, self.warmup = (
            decay,
            every_steps,
            start_step,
            warmup,
        )
        self._model = model
        tensors = model.state_dict(keep_vars=True)
        averages: dict[int, torch.Tensor] = {}  # by the live tensor's id: tied weights share one
        self._averaged: dict[str, torch.Tensor] = {}
        """The averages by the model's state-dict names."""
        self._live: list[torch.Tensor] = []
        """The model's tensors (detached), in the order of :attr:`_kept`."""
        self._kept: list[torch.Tensor] = []
        """Their averages."""
        for name, tensor in tensors.items():
            if id(tensor) not in averages:
                live = tensor.detach()
                kept = live.to(_kept_dtype(live.dtype), copy=True)
                averages[id(tensor)] = kept
                self._live.append(live)
                self._kept.append(kept)
            self._averaged[name] = averages[id(tensor)]
        self._groups = _groups(self._live, self._kept)

    def decay_at(self, step: int) -> float:
        """The decay of the update after optimizer step ``step``: ``0`` (a copy) until
        ``start_step``, then ``decay`` (or its warm-up form)."""
        if step <= self.start_step:
            return 0.0
        if not self.warmup:
            return self.decay
        n = (step - self.start_step) // self.every_steps
        return min(self.decay, (1 + n) / (WARMUP_UPDATES + n))

    def updates_at(self, step: int) -> bool:
        """Whether :meth:`update` changes the averages after step ``step``: every step until
        ``start_step``, then every ``every_steps``."""
        return step <= self.start_step or (step - self.start_step) % self.every_steps == 0

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Take optimizer step ``step`` (counted from 1) into the average, if it
        :meth:`updates_at` that step; call it after the optimizer's step."""
        if not self.updates_at(step):
            return
        weight = 1.0 - self.decay_at(step)
        for floating, kept, live in self._groups:
            if not floating or weight == 1.0:
                _copy(kept, live)
            elif kept[0].dtype == live[0].dtype:
                torch._foreach_lerp_(kept, live, weight)
            else:
                torch._foreach_lerp_(kept, [t.to(kept[0].dtype) for t in live], weight)

    @torch.no_grad()
    def reset(self) -> None:
        """Start the averages afresh from the model's weights as they are now."""
        for _, kept, live in self._groups:
            _copy(kept, live)

    def averaged(self) -> dict[str, torch.Tensor]:
        """The averages as a state dict of the model (the same names): what
        ``model.load_state_dict`` takes, for export or a warm start. Not copies."""
        return dict(self._averaged)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Within the block, the model holds the averages (cast to its dtypes); after it, its
        own weights again, to the bit."""
        with torch.no_grad():
            saved = [t.clone() for t in self._live]
            _copy(self._live, self._kept)
        try:
            yield
        finally:
            with torch.no_grad():
                _copy(self._live, saved)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: ``{"model": <the averages, by the model's names>}``."""
        return {"model": self.averaged()}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        :raises ValueError: naming the tensors missing or unexpected, for another model's.
        """
        saved = state["model"]
        missing, unexpected = self._averaged.keys() - saved, saved.keys() - self._averaged
        if missing or unexpected:
            raise ValueError(
                f"the EMA state is another model's: missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}"
            )
        for name, kept in self._averaged.items():
            kept.copy_(saved[name])


def _kept_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for a narrower floating dtype (bf16, fp16), else the tensor's own."""
    if dtype.is_floating_point and torch.finfo(dtype).bits < 32:
        return torch.float32
    return dtype


def _copy(into: list[torch.Tensor], source: list[torch.Tensor]) -> None:
    """``into[i].copy_(source[i])`` for each ``i``: one ``torch._foreach_copy_``, or a copy each
    for the shards of a sharded model (DTensors: ``_foreach_copy_`` has no sharding rule), each
    copying its rank's shard only."""
    if into and isinstance(into[0], DTensor):
        for a, b in zip(into, source, strict=True):
            a.copy_(b)
    else:
        torch._foreach_copy_(into, source)


def _groups(
    live: list[torch.Tensor], kept: list[torch.Tensor]
) -> list[tuple[bool, list[torch.Tensor], list[torch.Tensor]]]:
    """The pairs grouped by (floating, kept dtype, live dtype, device, sharded), for one
    foreach call each: ``(floating, kept, live)``."""
    groups: dict[tuple[Any, ...], tuple[bool, list[torch.Tensor], list[torch.Tensor]]] = {}
    for a, b in zip(kept, live, strict=True):
        floating = b.dtype.is_floating_point or b.dtype.is_complex  # averaged, else copied
        key = (floating, a.dtype, b.dtype, b.device, isinstance(b, DTensor))
        groups.setdefault(key, (floating, [], []))
        groups[key][1].append(a)
        groups[key][2].append(b)
    return list(groups.values())


def ema_name(name: str) -> str:
    """The name of a metric measured on the EMA's weights beside the live ones: ``loss_ema``,
    ``loss_ema/<task>``, ``<metric>_ema``, ``<metric>_ema/<task>``."""
    base, slash, task = name.partition("/")
    return f"{base}_ema{slash}{task}"


def evaluate_beside(
    ema: EMA | None, which: Evaluate, evaluate: Callable[[], dict[str, float]]
) -> dict[str, float]:
    """``evaluate()``'s metrics on the weights ``which`` names (the live ones without an EMA);
    with ``both``, the EMA's under :func:`ema_name`'s names beside the live ones' (but for
    ``samples``, the same count). A collective where ``evaluate`` is."""
    if ema is None or which == "live":
        return evaluate()
    with ema.applied():
        averaged = evaluate()
    if which == "ema":
        return averaged
    live = evaluate()
    return live | {ema_name(k): v for k, v in averaged.items() if k != "samples"}
