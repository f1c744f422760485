"""The ``bf16`` and ``fp16`` hooks on real gloo process groups, against DDP without a hook."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import structlog.testing
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ups.comm_hooks import CompressionState, plugin
from ups.core import CommHookPlugin, RunContext, load_plugins
from ups.core.testing import run_ranks

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
STEPS = 5
LR = 0.05


def register(name: str, ddp: DistributedDataParallel, ctx: RunContext) -> object | None:
    """Register the plugin ``name`` on ``ddp`` the way the engine does: through the registry."""
    registry = load_plugins(
        extra=[("ups-comm-hooks", plugin)], env={"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}
    )
    record, options = registry.select("comm_hook", name, {}, "comm_hook")
    assert isinstance(record, CommHookPlugin)
    return record.factory(ddp, ctx=ctx, options=options)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def portable(tensors: list[torch.Tensor]) -> bytes:
    """Tensors serialised, for returning from a rank: a queue sends tensors as shared memory,
    which vanishes when the rank exits, possibly before the parent has read it."""
    buffer = io.BytesIO()
    torch.save([t.detach() for t in tensors], buffer)
    return buffer.getvalue()


def tensors(data: bytes) -> list[torch.Tensor]:
    loaded: list[torch.Tensor] = torch.load(io.BytesIO(data), weights_only=True)
    return loaded


def train_with_and_without_hook(ctx: RunContext) -> dict[str, Any]:
    """Each rank its own data; a few SGD steps of the same model with each hook and with none."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    models = {name: copy.deepcopy(base) for name in ("none", *DTYPES)}
    # A tiny bucket cap: several buckets, so the hook runs more than once per step.
    ddps = {name: DistributedDataParallel(m, bucket_cap_mb=0.0005) for name, m in models.items()}
    states = {name: register(name, ddps[name], ctx) for name in DTYPES}
    optimizers = {name: torch.optim.SGD(d.parameters(), lr=LR) for name, d in ddps.items()}
    generator = torch.Generator().manual_seed(100 + ctx.rank)
    first_grads: dict[str, bytes] = {}
    for step in range(STEPS):
        x = torch.randn(16, 8, generator=generator)
        y = x.sum(dim=1, keepdim=True).sin()
        for name, ddp in ddps.items():
            optimizers[name].zero_grad()
            torch.autograd.backward(nn.functional.mse_loss(ddp(x), y))
            if step == 0:
                first_grads[name] = portable(grads(models[name]))
            optimizers[name].step()
    return {
        "initial": portable(list(base.parameters())),
        "params": {name: portable(list(m.parameters())) for name, m in models.items()},
        "first_grads": first_grads,
        "states": {
            name: (type(s).__name__, getattr(s, "dtype", None), s.process_group.size())
            for name, s in states.items()
            if isinstance(s, CompressionState)
        },
    }


@pytest.fixture(scope="module")
def trained() -> list[dict[str, Any]]:
    return run_ranks(train_with_and_without_hook, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", DTYPES)
def test_the_factory_returns_the_state_holding_the_ddp_group(
    trained: list[dict[str, Any]], name: str
) -> None:
    assert trained[0]["states"][name] == ("CompressionState", DTYPES[name], 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", DTYPES)
def test_gradients_are_averaged_in_16_bits(trained: list[dict[str, Any]], name: str) -> None:
    dtype = DTYPES[name]
    eps = torch.finfo(dtype).eps
    for rank in trained:
        first_grads = rank["first_grads"]
        for hooked, plain in zip(
            tensors(first_grads[name]), tensors(first_grads["none"]), strict=True
        ):
            # What came back went through the 16-bit dtype: it is exactly representable in it.
            assert torch.equal(hooked, hooked.to(dtype).float())
            assert not torch.equal(hooked, plain)
            scale = plain.abs().max().item()
            torch.testing.assert_close(hooked, plain, rtol=0, atol=2 * eps * scale)


@pytest.mark.slow
@pytest.mark.parametrize("name", DTYPES)
def test_parameters_follow_ddp_without_a_hook(trained: list[dict[str, Any]], name: str) -> None:
    eps = torch.finfo(DTYPES[name]).eps
    rank0, rank1 = ({key: tensors(p) for key, p in r["params"].items()} for r in trained)
    for p0, p1 in zip(rank0[name], rank1[name], strict=True):
        assert torch.equal(p0, p1)  # the replicas stay identical
    for hooked, plain in zip(rank0[name], rank0["none"], strict=True):
        # Every step moves them by LR times gradients (of size about 1) off by about eps.
        torch.testing.assert_close(hooked, plain, rtol=0, atol=STEPS * LR * eps)
    # ... and they did move from where they started.
    for initial, hooked in zip(tensors(trained[0]["initial"]), rank0[name], strict=True):
        assert not torch.equal(initial, hooked)


class Dot(nn.Module):
    """``loss = a . x[:3000] + b . x[3000:]``: the gradient is ``x``, whatever the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(3000))
        self.b = nn.Parameter(torch.ones(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a * x[:3000]).sum() + (self.b * x[3000:]).sum()


def gradients_of_the_same_inputs(
    ctx: RunContext,
) -> dict[tuple[str, str, bool], bytes]:
    """The gradients every rank gets when every rank has the same gradients: ``inputs``."""
    out = {}
    for name, dtype in DTYPES.items():
        for as_view in (False, True):
            model = Dot()
            ddp = DistributedDataParallel(
                model, bucket_cap_mb=0.005, gradient_as_bucket_view=as_view
            )
            register(name, ddp, ctx)
            for kind, x in inputs(dtype).items():
                model.zero_grad()
                torch.autograd.backward(ddp(x))
                flat = torch.cat([g.flatten() for g in grads(model)])
                out[name, kind, as_view] = portable([flat])
    return out


def inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The same on every rank: values exactly representable in ``dtype``, and arbitrary ones."""
    g = torch.Generator().manual_seed(0)
    # At most 8 significant bits (bf16 has 8, fp16 11); exponents inside fp16's normal range.
    exact = torch.randint(-255, 256, (3007,), generator=g) * 2.0 ** torch.randint(
        -6, 8, (3007,), generator=g
    )
    assert torch.equal(exact, exact.to(dtype).float())
    return {"exact": exact, "random": torch.randn(3007, generator=g) * 10}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_identical_gradients_come_back_rounded_once(world_size: int) -> None:
    for result in run_ranks(gradients_of_the_same_inputs, world_size):
        for (name, kind, as_view), data in result.items():
            (got,) = tensors(data)
            x = inputs(DTYPES[name])[kind]
            if kind == "exact":
                assert torch.equal(got, x), (name, as_view)
            else:
                # x / n (exact: n is 1 or 2) is rounded to 16 bits once; adding up the n equal
                # 16-bit values is exact.
                assert torch.equal(got, x.to(DTYPES[name]).float()), (name, as_view)
                assert not torch.equal(got, x)


def warnings_of_pointless_and_lossy_compression(ctx: RunContext) -> dict[str, list[str]]:
    """What each rank warns: bf16 compression of a bfloat16 model; fp16 compression of
    gradients under float16's range (as under fp16 autocast without a gradient scaler)."""
    seen = {}
    for case in ("bf16 of bf16", "fp16 tiny", "fp16 normal"):
        name = case[:4]
        model = Dot().to(torch.bfloat16) if case == "bf16 of bf16" else Dot()
        x = torch.full((3007,), 1e-9 if case == "fp16 tiny" else 1.0, dtype=model.a.dtype)
        with structlog.testing.capture_logs() as logs:
            ddp = DistributedDataParallel(model)
            register(name, ddp, ctx)
            for _ in range(2):  # warned once
                torch.autograd.backward(ddp(x))
        seen[case] = [e["event"] for e in logs if e["log_level"] == "warning"]
    return seen


@pytest.mark.slow
def test_pointless_or_lossy_compression_is_warned_once_on_rank_0() -> None:
    rank0, rank1 = run_ranks(warnings_of_pointless_and_lossy_compression, 2)
    assert rank1 == {"bf16 of bf16": [], "fp16 tiny": [], "fp16 normal": []}
    assert rank0["fp16 normal"] == []
    ((pointless,), (lossy,)) = rank0["bf16 of bf16"], rank0["fp16 tiny"]
    assert "bfloat16 already" in pointless and "use allreduce" in pointless
    assert "sent as zeros" in lossy and "GradScaler" in lossy
