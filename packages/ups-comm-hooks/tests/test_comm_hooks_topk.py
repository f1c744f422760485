"""The ``topk`` hook: its sparse average as a pure function (Hypothesis), and on real gloo process
groups of 1 to 4 ranks against a dense reference computed here from each rank's gradients; a
model that trains with it, a run resumed from its state that goes on bitwise, the bytes it
counts and the warnings it gives."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import structlog
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from resumable import Run
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ups.comm_hooks._topk import (
    SparseLayout,
    TopKOptions,
    TopKState,
    accumulation_dtype,
    top_k_count,
    topk_compression,
)
from ups.core import CommHookPlugin, ConfigError, RunContext, hookimpl, load_plugins
from ups.core.testing import assert_bitwise_equal, run_ranks

# ---------------------------------------------------------------------------------------------
# The pure computation


def test_k_is_the_ceiling_of_the_decimal_ratio_at_least_one() -> None:
    assert top_k_count(100, 0.07) == 7  # not 8, as 0.07 in binary times 100 would round up
    assert top_k_count(3000, 0.3) == 900
    assert top_k_count(7, 0.01) == 1
    assert top_k_count(3, 0.5) == 2
    assert top_k_count(5, 1.0) == 5
    assert top_k_count(0, 0.5) == 0


def test_positions_travel_in_int32_below_2_to_the_31_entries() -> None:
    assert SparseLayout.of([2**31 - 1], [1], torch.float32).index_dtype == torch.int32
    assert SparseLayout.of([2**30, 2**30], [1, 1], torch.float32).index_dtype == torch.int64


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@st.composite
def ranks_inputs(draw: st.DrawFn) -> tuple[SparseLayout, list[list[torch.Tensor]], Any]:
    """A bucket layout and, per rank, gradients and error feedback: arbitrary (from a seed),
    with ties among magnitudes when ``coarse``."""
    world = draw(st.integers(1, 5))
    numels = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    ratio = draw(st.sampled_from([1e-3, 0.05, 0.1, 0.25, 0.5, 0.999, 1.0]) | st.floats(1e-3, 1))
    dtype = draw(st.sampled_from(DTYPES))
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    coarse = draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    layout = SparseLayout.of(
        numels, [top_k_count(n, ratio) for n in numels], dtype, index_dtype=index_dtype
    )
    accumulate = accumulation_dtype(dtype)
    inputs = []
    for _ in range(world):
        grads, errors = [], []
        for n in numels:
            x = torch.randn(n, generator=g) * 4
            if coarse:  # a few values: equal magnitudes, zeros
                x = x.round()
            grads.append(x.to(dtype))
            errors.append(torch.randn(n, generator=g).to(accumulate) / 8)
        inputs.append([*grads, *errors])
    return layout, inputs, ratio


@settings(max_examples=150, deadline=None)
@given(ranks_inputs())
def test_the_sparse_average_is_the_mean_of_what_each_rank_sent(
    case: tuple[SparseLayout, list[list[torch.Tensor]], float],
) -> None:
    layout, inputs, _ = case
    n = len(layout.numels)
    accumulate = accumulation_dtype(layout.dtype)
    offsets = [sum(layout.numels[:i]) for i in range(n + 1)]
    packets, sent_dense = [], []
    for rank_inputs in inputs:
        grads, errors = rank_inputs[:n], rank_inputs[n:]
        before = [t.clone() for t in rank_inputs]
        packed, new_errors = layout.encode(grads, errors)
        assert_bitwise_equal(rank_inputs, before, "the inputs")  # left as they were
        assert packed.dtype == torch.uint8
        assert packed.numel() == layout.nbytes
        values, indices = layout.decode(packed)
        assert (values.dtype, indices.dtype) == (layout.dtype, layout.index_dtype)
        corrected = torch.cat([g.to(accumulate) + e for g, e in zip(grads, errors, strict=True)])
        # What was sent, as a dense tensor built here: each value at its position.
        sent = torch.zeros(layout.numel, dtype=accumulate)
        sent[indices.long()] = values.to(accumulate)
        for i, k in enumerate(layout.ks):
            lo, hi = offsets[i], offsets[i + 1]
            mine = indices[(indices >= lo) & (indices < hi)].long()
            assert torch.unique(mine).numel() == k  # k distinct entries of each parameter
            unsent = torch.ones(hi - lo, dtype=torch.bool)
            unsent[mine - lo] = False
            if unsent.any():  # the largest magnitudes (ties go either way)
                assert corrected[mine].abs().min() >= corrected[lo:hi][unsent].abs().max()
        assert indices.numel() == layout.count
        # The values are the corrected gradients' there, in the gradients' dtype.
        assert torch.equal(values, corrected[indices.long()].to(layout.dtype))
        # What was not sent is kept, exactly.
        new_error = torch.cat(new_errors)
        assert new_error.dtype == accumulate
        assert torch.equal(new_error + sent, corrected)
        if layout.dtype == accumulate:
            assert torch.equal(
                new_error[indices.long()], torch.zeros(layout.count, dtype=accumulate)
            )
        # One rank's average is what it sent.
        assert torch.equal(layout.average([packed]), sent)
        packets.append(packed)
        sent_dense.append(sent)
    reference = torch.zeros(layout.numel, dtype=accumulate)
    for sent in sent_dense:  # dense, in rank order
        reference = reference + sent
    reference = reference / len(inputs)
    assert torch.equal(layout.average(packets), reference)


def test_a_rank_whose_gradient_ties_sends_k_entries_all_the_same() -> None:
    layout = SparseLayout.of([6], [2], torch.float32)
    packed, (error,) = layout.encode([torch.ones(6)], [torch.zeros(6)])
    values, indices = layout.decode(packed)
    assert torch.equal(values, torch.ones(2))
    assert torch.unique(indices).numel() == 2
    assert error.sum() == 4


# ---------------------------------------------------------------------------------------------
# On real process groups: a model whose gradients are its inputs


SHAPES = [(7,), (20, 30), (1,), (3000,)]
"""Parameters of :class:`Dot`: small ones, a matrix, one entry, a large one. Their gradients are
ready in the reverse order, and DDP closes a bucket once it reaches the cap: the large one last
would make one bucket."""
BUCKET_CAP_MB = 0.002
"""Three buckets of float32 gradients once DDP has rebuilt them, two of bfloat16 (one in the
first backward pass)."""
NUMELS = [math.prod(s) for s in SHAPES]
STEPS = 3
START = 1
"""Steps all-reduced plainly in the tests of the gradients."""


class Dot(nn.Module):
    """``loss = sum_i <p_i, x_i>``: the gradient of ``p_i`` is ``x_i``, exactly."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.ones(s, dtype=dtype)) for s in SHAPES])

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return sum(((p * x).sum() for p, x in zip(self.ps, xs, strict=True)), torch.zeros(()))


def inputs(rank: int, step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Rank ``rank``'s gradients at ``step``."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


CONFIGS = [
    (dtype, as_view, ratio)
    for dtype in (torch.float32, torch.bfloat16)
    for as_view in (False, True)
    for ratio in (0.25, 1.0)
]


def hooked_gradients(ctx: RunContext) -> dict[str, Any]:
    """For each config, the gradients and this rank's error feedback after each step, the
    bytes counted per step, and the warnings logged at registration."""
    out: dict[str, Any] = {}
    for dtype, as_view, ratio in CONFIGS:
        model = Dot(dtype)
        ddp = DistributedDataParallel(
            model, bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=as_view
        )
        options = TopKOptions(ratio=ratio, start_iter=START, profile=ratio < 1)
        with structlog.testing.capture_logs() as logs:
            state = topk_compression(ddp, ctx=ctx, options=options)
        assert isinstance(state, TopKState)
        steps = []
        for step in range(STEPS):
            model.zero_grad()
            torch.autograd.backward(ddp(inputs(ctx.rank, step, dtype)))
            steps.append(
                {
                    "grads": [p.grad.detach().clone() for p in model.ps if p.grad is not None],
                    "errors": state.state_dict()["errors"],
                    "metrics": state.comm_metrics(1),
                }
            )
        out[str((dtype, as_view, ratio))] = {
            "steps": steps,
            "warnings": [e for e in logs if e["log_level"] == "warning"],
            "bytes": (state.sparse_bytes, state.dense_bytes),
        }
    return out


def reference(world: int, dtype: torch.dtype, ratio: float) -> list[dict[str, Any]]:
    """What the hook should give, computed densely: per step, the gradients (the same on every
    rank) and each rank's error feedback."""
    accumulate = accumulation_dtype(dtype)
    errors = [[torch.zeros(n, dtype=accumulate) for n in NUMELS] for _ in range(world)]
    out: list[dict[str, Any]] = []
    for step in range(STEPS):
        grads = [[x.reshape(-1) for x in inputs(rank, step, dtype)] for rank in range(world)]
        if step < START:
            mean = [
                sum((g[i].to(accumulate) for g in grads), torch.zeros(n, dtype=accumulate)) / world
                for i, n in enumerate(NUMELS)
            ]
            out.append({"grads": [m.to(dtype) for m in mean], "errors": None})
            continue
        total = [torch.zeros(n, dtype=accumulate) for n in NUMELS]
        for rank in range(world):  # dense sums in rank order, as the hook's sparse ones
            for i, n in enumerate(NUMELS):
                corrected = grads[rank][i].to(accumulate) + errors[rank][i]
                # torch's own top-k of the same tensor: the same entries where magnitudes tie
                chosen = torch.topk(corrected.abs(), top_k_count(n, ratio), sorted=False).indices
                sent = torch.zeros(n, dtype=accumulate)
                sent[chosen] = corrected[chosen].to(dtype).to(accumulate)
                total[i] = total[i] + sent
                errors[rank][i] = corrected - sent
        kept: list[list[torch.Tensor]] = [[e.clone() for e in rank] for rank in errors]
        out.append({"grads": [(t / world).to(dtype) for t in total], "errors": kept})
    return out


def check_gradients(results: list[dict[str, Any]]) -> None:
    world = len(results)
    for dtype, as_view, ratio in CONFIGS:
        key = str((dtype, as_view, ratio))
        expected = reference(world, dtype, ratio)
        for rank, result in enumerate(results):
            for step, (got, want) in enumerate(zip(result[key]["steps"], expected, strict=True)):
                where = f"{key} rank {rank} step {step}"
                grads = [g.reshape(-1) for g in got["grads"]]
                if step < START:  # DDP's all-reduce: g / world summed, in the ring's order
                    for g, w in zip(grads, want["grads"], strict=True):
                        # world roundings of values up to about 4 (randn) in the gradients' dtype
                        atol = world * torch.finfo(dtype).eps * 4
                        torch.testing.assert_close(g, w, rtol=0, atol=atol, msg=where)
                        if world <= 2:  # halving is exact, and adding two values commutes
                            assert torch.equal(g, w), where
                    continue
                # The same sums in the same order as the reference's: equal to the bit.
                assert_bitwise_equal(grads, want["grads"], where)
                errors = [got["errors"][f"ps.{i}"] for i in range(len(SHAPES))]
                assert_bitwise_equal(errors, want["errors"][rank], where)
                if ratio == 1:  # the plain mean (summed in rank order), nothing left over
                    accumulate = accumulation_dtype(dtype)
                    for i, g in enumerate(grads):
                        total = torch.zeros(NUMELS[i], dtype=accumulate)
                        for r in range(world):
                            total = total + inputs(r, step, dtype)[i].reshape(-1).to(accumulate)
                        assert torch.equal(g, (total / world).to(dtype)), where
                    assert all(not e.any() for e in errors), where


def check_bytes(results: list[dict[str, Any]]) -> None:
    for dtype, as_view, ratio in CONFIGS:
        key = str((dtype, as_view, ratio))
        size = torch.empty((), dtype=dtype).element_size()
        dense = sum(NUMELS) * size
        sparse = sum(max(1, math.ceil(ratio * n)) * (size + 4) for n in NUMELS)
        for result in results:
            steps = result[key]["steps"]
            assert result[key]["bytes"] == (sparse, dense)
            assert steps[0]["metrics"]["comm_bytes"] == dense  # all-reduced
            for step in steps[START:]:
                metrics = step["metrics"]
                assert metrics["comm_bytes"] == sparse
                if ratio < 1:  # profiled: per bucket, and they add up
                    buckets = [v for k, v in metrics.items() if re.fullmatch(r"comm_b\d+_bytes", k)]
                    assert len(buckets) == (3 if dtype == torch.float32 else 2), metrics
                    assert sum(buckets) == sparse, metrics
                    assert metrics["comm_s"] > 0


def check_warnings(results: list[dict[str, Any]]) -> None:
    world = len(results)
    for dtype, as_view, ratio in CONFIGS:
        key = str((dtype, as_view, ratio))
        sparse, dense = results[0][key]["bytes"]
        warnings = [e["event"] for e in results[0][key]["warnings"]]
        if ratio == 1:
            assert warnings == [
                "comm_hook topk: ratio 1 sends every value and an index for each: more bytes"
                " than allreduce"
            ]
        elif world * sparse >= 2 * dense:
            assert len(warnings) == 1
            assert "at least as many bytes as a ring all-reduce" in warnings[0]
        else:
            assert warnings == []
        for result in results[1:]:  # rank 0 only
            assert result[key]["warnings"] == []
    if world == 4:  # 903 of 3608 entries at 8 bytes: 4 ranks bring in 28896 >= 2 * 14432
        assert results[0][str((torch.float32, False, 0.25))]["warnings"]
    if world == 2:
        assert not results[0][str((torch.float32, False, 0.25))]["warnings"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3, 4])
def test_gradients_are_the_mean_of_each_ranks_top_k(world: int) -> None:
    results = run_ranks(hooked_gradients, world)
    check_gradients(results)
    check_bytes(results)
    check_warnings(results)


@pytest.mark.slow
def test_gradients_are_the_mean_of_each_ranks_top_k_on_2_ranks(
    two_ranks: list[dict[str, Any]],
) -> None:
    results = [r["gradients"] for r in two_ranks]
    check_gradients(results)
    check_bytes(results)
    check_warnings(results)


def test_the_reference_differs_from_the_plain_mean_below_ratio_1() -> None:
    """The tests above could fail: top-k of 0.25 is not the mean, error feedback is kept."""
    sparse = reference(2, torch.float32, 0.25)
    dense = reference(2, torch.float32, 1.0)
    assert not torch.equal(sparse[1]["grads"][0], dense[1]["grads"][0])
    assert sparse[1]["errors"][0][0].any()
    # Ratio 1: the plain mean of the step's gradients, summed in rank order.
    plain = (inputs(0, 1, torch.float32)[0] + inputs(1, 1, torch.float32)[0]) / 2
    assert torch.equal(dense[1]["grads"][0], plain)


# ---------------------------------------------------------------------------------------------
# Training and resuming, on 2 ranks

SMALL_BUCKETS = 0.005
ONE_BUCKET = 25.0
BEFORE, AFTER = 5, 4
"""Steps trained before the state is saved, and after."""
RESUME_OPTIONS = {"ratio": 0.1, "start_iter": 2}


def resume(ctx: RunContext) -> dict[str, Any]:
    """Train, save, go on; and resume from what was saved: with the same buckets, with one
    bucket (a layout the state was not kept in), and without the hook's state."""
    run = Run(ctx, RESUME_OPTIONS, SMALL_BUCKETS, hook="topk")
    run.train(range(BEFORE))
    saved = run.saved()
    run.train(range(BEFORE, BEFORE + AFTER))
    out: dict[str, Any] = {"uninterrupted": run.params(), "hook": saved["hook"]}
    for kind, cap, hook in (
        ("resumed", SMALL_BUCKETS, saved["hook"]),
        ("resumed with one bucket", ONE_BUCKET, saved["hook"]),
        ("resumed without the hook's state", SMALL_BUCKETS, None),
    ):
        again = Run(ctx, RESUME_OPTIONS, cap, resume={**saved, "hook": hook}, hook="topk")
        again.train(range(BEFORE, BEFORE + AFTER))
        out[kind] = again.params()
    errors = {}
    for kind, bad in (
        ("unknown", {"iter": 5, "errors": {"1.weight": torch.zeros(10)}}),
        ("size", {"iter": 5, "errors": {"0.bias": torch.zeros(10)}}),
    ):
        try:
            run.state.load_state_dict(bad)
        except ValueError as error:
            errors[kind] = str(error)
    out["load errors"] = errors
    return out


RATIO = 0.05
TRAIN_STEPS = 60


def regression(ctx: RunContext) -> dict[str, Any]:
    """Linear regression (16 inputs, 4 outputs, noise-free), each rank its own batches, with
    top-k of 0.05 from the first step: 4 of 64 weights and 1 of 4 biases sent per step."""
    torch.manual_seed(0)
    truth = torch.randn(16, 4)
    model = nn.Linear(16, 4)
    ddp = DistributedDataParallel(model)
    state = topk_compression(ddp, ctx=ctx, options=TopKOptions(ratio=RATIO, start_iter=0))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(ctx.rank)
    losses = []
    for _ in range(TRAIN_STEPS):
        x = torch.randn(32, 16, generator=g)
        loss = nn.functional.mse_loss(ddp(x), x @ truth)
        optimizer.zero_grad()
        torch.autograd.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "comm": state.comm_metrics(TRAIN_STEPS),
        "bytes": (state.sparse_bytes, state.dense_bytes),
    }


def overflow(ctx: RunContext) -> list[dict[str, Any]]:
    """Three steps of top-k; at the second, rank 1's gradient has an ``inf`` (as a float16 step
    that overflows): per step, the gradients and this rank's error feedback."""
    model = Dot(torch.float32)
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    state = topk_compression(ddp, ctx=ctx, options=TopKOptions(ratio=0.25, start_iter=0))
    out = []
    for step in range(3):
        xs = inputs(ctx.rank, step, torch.float32)
        if step == 1 and ctx.rank == 1:
            xs[3][5] = math.inf
        model.zero_grad()
        torch.autograd.backward(ddp(xs))
        grads = [p.grad.detach().clone() for p in model.ps if p.grad is not None]
        out.append({"grads": grads, "errors": state.state_dict()["errors"]})
    return out


def two_rank_tests(ctx: RunContext) -> dict[str, Any]:
    return {
        "gradients": hooked_gradients(ctx),
        "resume": resume(ctx),
        "train": regression(ctx),
        "overflow": overflow(ctx),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(two_rank_tests, 2, timeout_s=120)


@pytest.mark.slow
def test_a_regression_trains_with_5_percent_sent(two_ranks: list[dict[str, Any]]) -> None:
    losses = [r["train"]["losses"] for r in two_ranks]
    for rank in losses:
        first, last = sum(rank[:5]) / 5, sum(rank[-5:]) / 5
        assert last < first / 100, (first, last)
    # The replicas stay identical: every rank computed the same average, to the bit.
    assert_bitwise_equal(two_ranks[0]["train"]["params"], two_ranks[1]["train"]["params"])
    # 4 weights and 1 bias, each with an int32 position: 40 bytes of 272.
    assert two_ranks[0]["train"]["bytes"] == (40, 68 * 4)
    assert two_ranks[0]["train"]["comm"] == {"comm_bytes": 40.0}


@pytest.mark.slow
def test_a_bucket_that_overflows_leaves_the_error_feedback_as_it_was(
    two_ranks: list[dict[str, Any]],
) -> None:
    for rank in two_ranks:
        before, overflowed, after = rank["overflow"]
        # The inf is the largest: sent, so every rank's average has it (a GradScaler skips
        # the step) ...
        assert overflowed["grads"][3][5] == math.inf
        # ... and the error feedback of the parameters in its bucket is the last step's, on
        # every rank; in the other buckets it moved on.
        assert_bitwise_equal(overflowed["errors"]["ps.3"], before["errors"]["ps.3"])
        assert not torch.equal(overflowed["errors"]["ps.0"], before["errors"]["ps.0"])
        # The next step is finite again.
        assert all(g.isfinite().all() for g in after["grads"])
        assert all(e.isfinite().all() for e in after["errors"].values())


@pytest.mark.slow
def test_a_resumed_run_goes_on_bitwise_as_the_uninterrupted_one(
    two_ranks: list[dict[str, Any]],
) -> None:
    for rank in two_ranks:
        results = rank["resume"]
        assert_bitwise_equal(results["resumed"], results["uninterrupted"], "params")
        # Buckets laid out otherwise: the selection is per parameter, the sums per entry.
        assert_bitwise_equal(results["resumed with one bucket"], results["uninterrupted"])
        # ... which would not be without the hook's state: the test can fail.
        without = results["resumed without the hook's state"]
        assert not all(
            torch.equal(a, b) for a, b in zip(without, results["uninterrupted"], strict=True)
        )
    assert_bitwise_equal(two_ranks[0]["resume"]["resumed"], two_ranks[1]["resume"]["resumed"])


@pytest.mark.slow
def test_the_state_dict_holds_each_parameters_error_feedback_on_the_cpu(
    two_ranks: list[dict[str, Any]],
) -> None:
    states = [r["resume"]["hook"] for r in two_ranks]
    names = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    for state in states:
        assert set(state) == {"iter", "ratio", "errors"}
        assert (state["iter"], state["ratio"]) == (BEFORE, 0.1)
        assert sorted(state["errors"]) == sorted(names)
        for error in state["errors"].values():
            assert error.device.type == "cpu"
            assert error.dtype == torch.float32
            assert error.dim() == 1
            assert error.any()
    # Each rank's own.
    assert not torch.equal(states[0]["errors"]["0.weight"], states[1]["errors"]["0.weight"])


@pytest.mark.slow
def test_a_state_of_another_model_is_refused(two_ranks: list[dict[str, Any]]) -> None:
    errors = two_ranks[0]["resume"]["load errors"]
    assert errors["unknown"].startswith(
        "the top-k state holds error feedback for '1.weight', which this model does not train"
    )
    assert errors["size"] == (
        "the top-k state holds 10 entries of error feedback for '0.bias', which has 48"
    )


# ---------------------------------------------------------------------------------------------
# Options, through a registry as the engine builds them


class TopKPlugin:
    """The record plugin.py registers (the test registers it itself)."""

    @hookimpl
    def ups_comm_hooks(self) -> list[CommHookPlugin]:
        return [
            CommHookPlugin(
                name="topk",
                factory=topk_compression,
                options=TopKOptions,
                description="top-k sparsification with error feedback",
            )
        ]


def select(options: dict[str, Any]) -> Any:
    registry = load_plugins(
        extra=[("topk-test", TopKPlugin())], env={"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}
    )
    record, built = registry.select("comm_hook", "topk", options, "comm_hook")
    assert record.factory is topk_compression
    return built


def test_the_options_default_to_one_percent_after_ten_plain_steps() -> None:
    assert select({}) == TopKOptions(ratio=0.01, start_iter=10, profile=False)
    built = select({"ratio": 1, "start_iter": 0, "profile": True})
    assert built == TopKOptions(ratio=1.0, start_iter=0, profile=True)
    assert isinstance(built.ratio, float)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ratio": 0}, r"comm_hook\.options\.ratio: 0\.0 .*> 0"),
        ({"ratio": 1.5}, r"comm_hook\.options\.ratio: 1\.5 .*<= 1"),
        ({"start_iter": -1}, r"comm_hook\.options\.start_iter: -1 .*>= 0"),
        ({"k": 3}, r"comm_hook\.options\.k: unknown key"),
    ],
)
def test_bad_options_are_refused_naming_the_key(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        select(options)
