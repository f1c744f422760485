"""A hook by name on a hand-written loop's DDP model: what the engine does for ``comm_hook:``.

The names and options are the plugin's own records (:mod:`ups.comm_hooks.plugin`), and the
factory called is the one the engine calls, so a hook behaves the same in ``ups train`` and in a
loop of one's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ups.core import RunContext
from ups.core.config import check_type
from ups.core.plugin import chosen

from .plugin import ups_comm_hooks


def register_hook(
    ddp: DistributedDataParallel,
    name: str,
    *,
    ctx: RunContext,
    options: Mapping[str, Any] | object | None = None,
) -> Any:
    """Register the communication hook ``name`` on ``ddp``; return its state.

    The state counts the bytes the hook hands to collectives (``comm_metrics(steps)``) and has
    ``state_dict()`` and ``load_state_dict(state)``, each rank's own, to checkpoint with the
    model so that a resumed run goes on bitwise: what a hook with memory across steps
    (``powersgd``, ``batched_powersgd``, ``topk``) keeps, ``{}`` for the others.

    :param ddp: the model, wrapped in ``DistributedDataParallel`` (before its first step).
    :param name: ``allreduce``, ``bf16``, ``fp16``, ``powersgd``, ``batched_powersgd``, ``topk``.
    :param ctx: this rank's run context (:func:`ups.core.distributed_session`).
    :param options: the hook's options, as a mapping (``{"matrix_approximation_rank": 2}``)
        or an instance of its options class; ``None``: the defaults.
    :raises ConfigError: naming the argument: an unknown ``name`` (with the closest one), an
        unknown option or one of the wrong type; for an argument of the wrong type, an
        :class:`~ups.core.config.ArgumentTypeError` (a ``TypeError`` too).
    """
    record, options = chosen(ups_comm_hooks(), name, ctx=ctx, options=options)
    check_type("ddp", ddp, DistributedDataParallel, "a DistributedDataParallel model")
    return record.factory(ddp, ctx=ctx, options=options)
