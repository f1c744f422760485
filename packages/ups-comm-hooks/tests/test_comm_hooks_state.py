"""Every hook's state checkpoints alike in a loop of one's own: a hook without memory has a
state too (``{}``), which goes through ``torch.load(weights_only=True)`` and refuses another
hook's state, on real gloo ranks."""

from __future__ import annotations

import io

import torch
from torch.nn.parallel import DistributedDataParallel

from ups.comm_hooks import register_hook
from ups.core import RunContext
from ups.core.testing import run_ranks

STATELESS = ("allreduce", "bf16", "fp16")


def _save_and_load(ctx: RunContext) -> dict[str, object]:
    found: dict[str, object] = {}
    powersgd = register_hook(
        DistributedDataParallel(torch.nn.Linear(8, 8)), "powersgd", ctx=ctx, options=None
    )
    for name in STATELESS:
        ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
        hook = register_hook(ddp, name, ctx=ctx)
        ddp(torch.randn(2, 4)).sum().backward()
        saved = io.BytesIO()
        torch.save({"hook": hook.state_dict()}, saved)
        loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)["hook"]
        hook.load_state_dict(loaded)
        try:
            hook.load_state_dict(powersgd.state_dict())
            refused = ""
        except ValueError as error:
            refused = str(error)
        found[name] = (loaded, refused)
    return found


def test_a_hook_without_memory_saves_nothing_and_refuses_another_hooks_state() -> None:
    for result in run_ranks(_save_and_load, 2):
        for name in STATELESS:
            loaded, refused = result[name]  # type: ignore[misc]
            assert loaded == {}, name
            assert refused.startswith("this hook keeps no state between steps; the state "), name
            assert refused.endswith("was it saved by another hook?"), name
