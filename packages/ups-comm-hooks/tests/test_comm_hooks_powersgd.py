"""The ``powersgd`` and ``batched_powersgd`` hooks on real gloo process groups: a run resumed
from the hook's ``state_dict`` (and the model's and optimizer's) goes on bitwise as the run it
continues, with gradients sent as they are or in 16 bits (``wire_dtype``)."""

from __future__ import annotations

import io
import math
import traceback
from typing import Any, NamedTuple

import pytest
import torch
from resumable import Run, model, registry_select
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    batched_powerSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel

from ups.comm_hooks import (
    PowerSGDOptions,
    batched_powersgd_compression,
    powersgd_compression,
)
from ups.core import ConfigError, RunContext
from ups.core.testing import run_ranks

SMALL_BUCKETS = 0.005
"""A bucket cap (MiB) that splits :func:`model`'s parameters into two buckets."""
ONE_BUCKET = 25.0
"""DDP's default cap: one bucket, whose parameters are in the reverse order of the model's
after DDP rebuilds it, and in the model's order before."""
AFTER = 4
"""Steps trained after the state is saved."""


class Scenario(NamedTuple):
    options: dict[str, Any]
    cap: float
    """The bucket cap of the saved run."""
    resumed_cap: float
    """The bucket cap of the resumed run."""
    before: int
    """Steps trained before saving."""
    hook: str = "powersgd"


LARGER = {"start_powersgd_iter": 3, "matrix_approximation_rank": 1, "min_compression_rate": 1}
SCENARIOS: dict[str, Scenario] = {
    "two buckets": Scenario({"start_powersgd_iter": 3}, SMALL_BUCKETS, SMALL_BUCKETS, 5),
    "one bucket": Scenario({"start_powersgd_iter": 3}, ONE_BUCKET, ONE_BUCKET, 5),
    "saved as PowerSGD starts, without warm start nor error feedback": Scenario(
        {"start_powersgd_iter": 3, "warm_start": False, "use_error_feedback": False},
        SMALL_BUCKETS,
        SMALL_BUCKETS,
        3,
    ),
    "resumed with larger buckets": Scenario(LARGER, SMALL_BUCKETS, ONE_BUCKET, 5),
    "bf16 wire, two buckets": Scenario(
        {"start_powersgd_iter": 3, "wire_dtype": "bf16"}, SMALL_BUCKETS, SMALL_BUCKETS, 5
    ),
    "fp16 wire, resumed with larger buckets": Scenario(
        {**LARGER, "wire_dtype": "fp16"}, SMALL_BUCKETS, ONE_BUCKET, 5
    ),
    "batched, two buckets": Scenario(
        {"start_powersgd_iter": 3}, SMALL_BUCKETS, SMALL_BUCKETS, 5, "batched_powersgd"
    ),
    "batched, one bucket": Scenario(
        {"start_powersgd_iter": 3}, ONE_BUCKET, ONE_BUCKET, 5, "batched_powersgd"
    ),
    "batched, without warm start nor error feedback": Scenario(
        {"start_powersgd_iter": 3, "warm_start": False, "use_error_feedback": False},
        SMALL_BUCKETS,
        SMALL_BUCKETS,
        3,
        "batched_powersgd",
    ),
    "batched, bf16 wire, resumed with larger buckets": Scenario(
        {**LARGER, "wire_dtype": "bf16"}, SMALL_BUCKETS, ONE_BUCKET, 5, "batched_powersgd"
    ),
}


def resume_every_scenario(ctx: RunContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (options, cap, resumed_cap, before, hook) in SCENARIOS.items():
        run = Run(ctx, options, cap, hook=hook)
        run.train(range(before))
        saved = run.saved()
        run.train(range(before, before + AFTER))
        results = {"uninterrupted": run.params(), "hook_state": saved.pop("hook_bytes")}
        without_layout = {**saved, "hook": {**saved["hook"], "buckets": {}}}
        for kind, resume in (
            ("resumed", saved),
            ("resumed without the hook's state", {**saved, "hook": None}),
            ("resumed without the saved bucket layout", without_layout),
        ):
            again = Run(ctx, options, resumed_cap, resume=resume, hook=hook)
            try:
                again.train(range(before, before + AFTER))
            except RuntimeError as error:  # the same on every rank, before any collective
                results[kind] = str(error)
            else:
                results[kind] = again.params()
        out[name] = results
    out["errors"] = errors_of_states_the_hook_cannot_continue(ctx)
    out["torch's batched hook"] = torch_batched_hook_error(ctx)
    return out


def errors_of_states_the_hook_cannot_continue(ctx: RunContext) -> dict[str, str]:
    errors = {}
    run = Run(ctx, {"start_powersgd_iter": 2}, SMALL_BUCKETS)
    run.train(range(3))
    saved = run.saved()
    for key, value in (
        ("matrix_approximation_rank", 1),
        ("min_compression_rate", 1.5),
        ("wire_dtype", "bf16"),
    ):
        try:
            Run(ctx, {"start_powersgd_iter": 2, key: value}, SMALL_BUCKETS, resume=saved)
        except ValueError as error:
            errors[key] = str(error)
    try:
        Run(ctx, {"start_powersgd_iter": 2}, SMALL_BUCKETS, resume=saved, hook="batched_powersgd")
    except ValueError as error:
        errors["batched"] = str(error)
    # A state saved before batched and wire_dtype existed is one of powersgd sent as it is.
    older = {k: v for k, v in saved["hook"].items() if k not in ("batched", "wire_dtype")}
    Run(ctx, {"start_powersgd_iter": 2}, SMALL_BUCKETS, resume={**saved, "hook": older})
    # Saved with two buckets, resumed with one: fine (it is cut in two). The other way: not.
    run = Run(ctx, {"start_powersgd_iter": 2}, ONE_BUCKET)
    run.train(range(3))
    smaller = Run(ctx, {"start_powersgd_iter": 2}, SMALL_BUCKETS, resume=run.saved())
    try:
        smaller.train(range(3, 5))
    except RuntimeError as error:
        errors["smaller buckets"] = str(error)
    return errors


def torch_batched_hook_error(ctx: RunContext) -> str:
    """What torch's ``batched_powerSGD_hook`` raises at its first compressing step."""
    ddp = DistributedDataParallel(model(seed=0))
    ddp.register_comm_hook(PowerSGDState(None, start_powerSGD_iter=2), batched_powerSGD_hook)
    for _ in range(3):
        try:
            torch.autograd.backward(ddp(torch.ones(2, 16)).sum())
        except AssertionError as error:
            return "".join(traceback.format_exception(error))
    return "no error"


@pytest.fixture(scope="module")
def resumed() -> list[dict[str, Any]]:
    return run_ranks(resume_every_scenario, 2)


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_resumed_run_goes_on_bitwise_as_the_uninterrupted_one(
    resumed: list[dict[str, Any]], scenario: str
) -> None:
    for rank in resumed:
        results = rank[scenario]
        assert equal(results["resumed"], results["uninterrupted"])
        # ... which it would not without the hook's state: the test can fail.
        assert not equal(results["resumed without the hook's state"], results["uninterrupted"])
    # The replicas stay identical.
    assert equal(resumed[0][scenario]["resumed"], resumed[1][scenario]["resumed"])


@pytest.mark.slow
def test_the_saved_bucket_layout_is_what_keeps_the_first_resumed_step_exact(
    resumed: list[dict[str, Any]],
) -> None:
    for rank in resumed:
        # Two buckets saved; DDP's first step has one: the error feedback does not fit it.
        assert (
            "must match the size of tensor"
            in (rank["two buckets"]["resumed without the saved bucket layout"])
        )
        # One bucket saved, and one bucket of the same length in the first step, its parameters
        # in the reverse order: the error feedback fits, and lands on the wrong parameters.
        results = rank["one bucket"]
        wrong = results["resumed without the saved bucket layout"]
        assert not equal(wrong, results["uninterrupted"])


@pytest.mark.slow
def test_the_state_dict_loads_with_weights_only(resumed: list[dict[str, Any]]) -> None:
    states = [
        torch.load(io.BytesIO(rank["two buckets"]["hook_state"]), weights_only=True)
        for rank in resumed
    ]
    for state in states:
        assert state["iter"] == 5
        assert (state["matrix_approximation_rank"], state["min_compression_rate"]) == (2, 2.0)
        assert set(state["rng"]) == {"key", "pos", "has_gauss", "gauss"}
        assert state["rng"]["key"].shape == (624,)
        # Two buckets, which hold every parameter; each has its error feedback and its P and Q
        # memories, on the CPU.
        assert sorted(state["buckets"]) == [0, 1]
        assert sorted(n for names in state["buckets"].values() for n in names) == sorted(
            name for name, _ in model(seed=0).named_parameters()
        )
        for key in ("error_dict", "p_memory_dict", "q_memory_dict"):
            assert sorted(state[key]) == [0, 1]
            assert all(t.device.type == "cpu" for t in state[key].values())
    # The error feedback is each rank's own; the generator is the same on all.
    assert not torch.equal(states[0]["error_dict"][0], states[1]["error_dict"][0])
    assert torch.equal(states[0]["rng"]["key"], states[1]["rng"]["key"])
    assert (states[0]["batched"], states[0]["wire_dtype"]) == (False, None)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scenario", "dtype", "batched"),
    [
        ("bf16 wire, two buckets", torch.bfloat16, False),
        ("fp16 wire, resumed with larger buckets", torch.float16, False),
        ("batched, two buckets", torch.float32, True),
        ("batched, bf16 wire, resumed with larger buckets", torch.bfloat16, True),
    ],
)
def test_the_state_holds_the_wire_dtype_tensors_and_the_hook(
    resumed: list[dict[str, Any]], scenario: str, dtype: torch.dtype, batched: bool
) -> None:
    for rank in resumed:
        state = torch.load(io.BytesIO(rank[scenario]["hook_state"]), weights_only=True)
        assert state["batched"] is batched
        assert state["wire_dtype"] == SCENARIOS[scenario].options.get("wire_dtype")
        for key in ("error_dict", "p_memory_dict", "q_memory_dict"):
            assert {t.dtype for t in state[key].values()} == {dtype}, key
        if batched:  # error feedback of the padded square; P and Q of side x rank
            rank_ = state["matrix_approximation_rank"]
            for i, error in state["error_dict"].items():
                side = math.isqrt(error.numel())
                assert side * side == error.numel()
                assert state["p_memory_dict"][i].shape == (side, rank_)
                assert state["q_memory_dict"][i].shape == (side, rank_)


@pytest.mark.slow
def test_a_state_the_hook_cannot_continue_is_refused(resumed: list[dict[str, Any]]) -> None:
    for rank in resumed:
        errors = rank["errors"]
        assert errors["matrix_approximation_rank"] == (
            "the PowerSGD state was saved with matrix_approximation_rank 2, not 1 as now"
        )
        assert errors["min_compression_rate"] == (
            "the PowerSGD state was saved with min_compression_rate 2.0, not 1.5 as now"
        )
        assert errors["wire_dtype"] == (
            "the PowerSGD state was saved with wire_dtype None, not 'bf16' as now"
        )
        assert errors["batched"] == (
            "the PowerSGD state was saved with batched False, not True as now"
        )
        smaller = errors["smaller buckets"]
        assert "powersgd: bucket 0 of this DDP model holds the parameters" in smaller
        assert "Resume with the model and the DDP options (bucket_cap_mb)" in smaller


@pytest.mark.slow
def test_torch_batched_hook_still_fails_which_is_why_batched_powersgd_is_our_own(
    resumed: list[dict[str, Any]],
) -> None:
    for rank in resumed:
        error = rank["torch's batched hook"]
        assert "_orthogonalize(state.q_memory_dict[bucket_index])" in error, error


def test_the_plugins_take_powersgd_options() -> None:
    record, options = registry_select("powersgd", {"matrix_approximation_rank": 4, "seed": 7})
    assert (record.factory, record.options) == (powersgd_compression, PowerSGDOptions)
    batched, batched_options = registry_select("batched_powersgd", {"wire_dtype": "bf16"})
    assert (batched.factory, batched.options) == (batched_powersgd_compression, PowerSGDOptions)
    assert batched_options == PowerSGDOptions(wire_dtype="bf16")
    assert options == PowerSGDOptions(matrix_approximation_rank=4, seed=7)
    assert registry_select("powersgd", {})[1] == PowerSGDOptions(
        matrix_approximation_rank=2,
        start_powersgd_iter=10,
        min_compression_rate=2.0,
        use_error_feedback=True,
        warm_start=True,
        orthogonalization_epsilon=0.0,
        seed=0,
        wire_dtype=None,
        profile=False,
    )
    _, options = registry_select("powersgd", {"wire_dtype": "fp16", "profile": True})
    assert (options.wire_dtype, options.profile) == ("fp16", True)
    _, options = registry_select("powersgd", {"min_compression_rate": 1})
    assert options.min_compression_rate == 1.0
    assert isinstance(options.min_compression_rate, float)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"matrix_approximation_rank": 0},
            r"comm_hook\.options\.matrix_approximation_rank: 0 .*>= 1",
        ),
        ({"start_powersgd_iter": 1}, r"comm_hook\.options\.start_powersgd_iter: 1 .*>= 2"),
        ({"orthogonalization_epsilon": -1e-8}, r"orthogonalization_epsilon: -1e-08 .*>= 0"),
        ({"min_compression_rate": -1}, r"comm_hook\.options\.min_compression_rate: -1.0 .*>= 0"),
        ({"seed": 2**32}, r"comm_hook\.options\.seed: 4294967296 .*< 2\*\*32"),
        ({"wire_dtype": "int8"}, r"comm_hook\.options\.wire_dtype: 'int8'"),
        ({"warm_start": "yes"}, r"comm_hook\.options\.warm_start: expected a boolean"),
        ({"start_powerSGD_iter": 10}, r"comm_hook\.options\.start_powerSGD_iter: unknown key"),
    ],
)
def test_bad_options_are_refused_naming_the_key(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        registry_select("powersgd", options)
