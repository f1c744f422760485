"""A strategy by name for a hand-written loop: what the engine builds for ``strategy:``.

The names and options are the plugin's own records (:mod:`ups.fsdp.plugin`) and the factory
called is the one the engine calls, so a strategy behaves the same in ``ups train`` and in a
loop of one's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from ups.core import RunContext, Strategy, config_from_mapping
from ups.core.config import check_type, choice
from ups.core.plugin import chosen

from .plugin import ups_strategies

OWN_LOOP = "ups.fsdp:own_loop"
"""The model and data factories of the config a loop of one's own has none of: never loaded
(a strategy reads only ``training`` and ``distributed``)."""


def strategy(
    name: str,
    *,
    ctx: RunContext,
    options: Mapping[str, Any] | object | None = None,
    precision: Literal["fp32", "bf16"] = "fp32",
    compile: bool = False,
) -> Strategy:
    """The strategy ``name`` for this rank, as ``strategy: {name, options}`` builds it.

    Then, in the loop: ``model = s.wrap(model)``, ``optimizer = s.optimizer(build, model)``
    (``build(parameters)`` makes your optimizer), ``s.backward_unsynced(loss, model)`` for the
    micro-batches before a step's last (plain ``loss.backward()`` for the last),
    ``s.clip_grad_norm(model.parameters(), max_norm)``, and for checkpoints
    ``s.gathered(model.state_dict())`` and ``s.optimizer_state(optimizer)`` (full tensors, a
    collective), loaded back with ``model.load_state_dict(s.scattered(saved, model.state_dict()))``
    and ``s.load_optimizer_state(optimizer, saved)``.

    :param name: ``zero`` or ``fsdp``.
    :param ctx: this rank's run context (:func:`ups.core.distributed_session`).
    :param options: the strategy's options, as a mapping (``{"reshard_after_forward": False}``)
        or an instance of its options class; ``None``: the defaults.
    :param precision: the precision the loop runs in (``bf16``: ``fsdp`` gathers its
        parameters in bfloat16); the loop's own autocast is up to it.
    :param compile: ``torch.compile`` the model as :meth:`~ups.core.Strategy.wrap` wraps it
        (``fsdp``: each block).
    :raises ConfigError: naming the argument: an unknown ``name`` (with the closest one), an
        unknown option or one of the wrong type; for an argument of the wrong type, an
        :class:`~ups.core.config.ArgumentTypeError` (a ``TypeError`` too).
    """
    record, options = chosen(ups_strategies(), name, ctx=ctx, options=options)
    precision = choice("precision", precision, ["fp32", "bf16"])
    check_type("compile", compile, bool, "True or False")
    config = config_from_mapping(
        {
            "model": {"factory": OWN_LOOP},
            "data": {"factory": OWN_LOOP},
            "training": {"precision": precision, "compile": compile},
            "strategy": {"name": name},
        }
    )
    made: Strategy = record.factory(ctx=ctx, config=config, options=options)
    return made
