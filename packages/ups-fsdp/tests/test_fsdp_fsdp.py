"""The ``fsdp`` strategy on real gloo ranks: it trains as ``ddp`` and as one process do (to
1e-5 in fp32, ranks of unequal counts, micro-batches of unequal sizes, clipped, AdamW), its
evaluations run no collective, its checkpoints hold full tensors that resume under it (to the
bit) or on one process, and each rank holds about half the parameters of ``ddp``'s."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from core_tests import core_tests, loaded
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp import FSDPModule

import ups.fsdp.plugin
from ups.core import EMA, Config, ConfigError, RunContext
from ups.core.engine import train_rank
from ups.core.plugin._manager import AUTOLOAD_ENV, load_plugins
from ups.core.testing import assert_bitwise_equal, assert_params_close, read_checkpoint, run_ranks

weighting = core_tests("test_core_weighting")
"""Their configs, model and data, and the ``Lopsided`` sampler giving ranks unequal counts."""
WORLD = 2
Params = dict[str, torch.Tensor]


def registry() -> Any:
    """The built-in plugins, ups-fsdp's strategies and the ``lopsided`` sampler."""
    extra = [("lopsided", weighting.LOPSIDED), ("ups-fsdp", ups.fsdp.plugin)]
    return load_plugins(extra=extra, env={AUTOLOAD_ENV: "1"})


def config(folder: Path, shape: tuple[int, int, list[int], int], /, **sections: Any) -> Config:
    """A run of ``weighting.config`` on the ``lopsided`` sampler's ``shape`` with AdamW,
    clipped, ``strategy`` and other sections as given."""
    batch, accumulation, last, samples = shape
    options = {"block": batch * accumulation, "last": last}
    training = {"optimizer": "adamw", "lr": 0.01, "grad_clip_norm": 0.3}
    return weighting.config(
        folder,
        batch,
        accumulation,
        samples,
        **{
            "sampler": {"name": "lopsided", "options": options},
            **sections,
            "training": training | sections.get("training", {}),
        },
    )


def fsdp(**options: Any) -> dict[str, Any]:
    return {"name": "fsdp", "options": options}


def results(ctx: RunContext, configs: list[Config]) -> list[dict[str, Any]]:
    """Train each config in turn on this rank: its final checkpoint's state and its
    evaluations."""
    found = []
    for each in configs:
        result = train_rank(each, ctx, registry())
        assert result.checkpoint is not None
        state = read_checkpoint(result.checkpoint)["state"]
        found.append({"state": state, "evals": result.eval_metrics, "at": result.checkpoint})
    return found


def on_ranks(configs: list[Config], world: int = WORLD) -> list[dict[str, Any]]:
    return run_ranks(results, world, configs)[0]


def alone(configs: list[Config]) -> list[dict[str, Any]]:
    return results(RunContext(), configs)


@st.composite
def steps(draw: st.DrawFn) -> tuple[int, int, list[int], int]:
    """``weighting.lopsided_steps`` of 2 micro-batches or more a step."""
    return draw(weighting.lopsided_steps().filter(lambda shape: shape[1] > 1))


# ---------------------------------------------------------------------------------------------
# Training


@pytest.mark.slow
@settings(max_examples=3, deadline=None)
@given(shape=steps())
def test_fsdp_trains_as_ddp_and_one_process(
    tmp_path_factory: pytest.TempPathFactory, shape: tuple[int, int, list[int], int]
) -> None:
    """2 ranks of unequal counts (``lopsided``) under ``fsdp`` (resharding after the forward
    or not) ≡ ``ddp`` ≡ one process over the same samples, to 1e-5."""
    batch, accumulation, last, _ = shape
    folder = tmp_path_factory.mktemp("fsdp")
    ranks = on_ranks(
        [
            config(folder / "ddp", shape),
            config(folder / "zero3", shape, strategy=fsdp()),
            config(folder / "zero2", shape, strategy=fsdp(reshard_after_forward=False)),
        ]
    )
    whole = {"block": WORLD * batch * accumulation, "last": [sum(last)]}
    big = {"batch_size": WORLD * batch * accumulation, "accumulation_steps": 1}
    one = alone(
        [
            config(
                folder / "one",
                shape,
                sampler={"name": "lopsided", "options": whole},
                training=big,
            )
        ]
    )[0]
    for found in ranks:
        assert_params_close(found["state"]["model"], one["state"]["model"], atol=1e-5)
        assert_params_close(found["state"]["model"], ranks[0]["state"]["model"], atol=1e-5)


@pytest.mark.slow
def test_hybrid_sharding_over_4_ranks_trains_as_ddp(tmp_path: Path) -> None:
    """``replicate: 2`` on 4 ranks (2 groups of 2 shards) ≡ ``ddp``, accumulating, clipped."""
    each = {"training": {"optimizer": "adamw", "lr": 0.01, "grad_clip_norm": 0.3}}
    ddp, hybrid = on_ranks(
        [
            weighting.config(tmp_path / "ddp", 2, 2, 4 * 2 * 2 + 4 * 3, **each),
            weighting.config(
                tmp_path / "hsdp", 2, 2, 4 * 2 * 2 + 4 * 3, **each, strategy=fsdp(replicate=2)
            ),
        ],
        world=4,
    )
    assert_params_close(hybrid["state"]["model"], ddp["state"]["model"], atol=1e-5)


@pytest.mark.slow
def test_compiled_blocks_train_as_ddp(tmp_path: Path) -> None:
    """``training.compile``: each block compiled, then sharded; the same training as ``ddp``
    without compiling, to 1e-5."""
    shape = (2, 2, [3, 4], 2 * 2 * 2 + 7)
    ddp, compiled = on_ranks(
        [
            config(tmp_path / "ddp", shape),
            config(tmp_path / "compiled", shape, strategy=fsdp(), training={"compile": True}),
        ]
    )
    assert_params_close(compiled["state"]["model"], ddp["state"]["model"], atol=1e-5)


@pytest.mark.slow
def test_bf16_gathers_bf16_and_keeps_fp32_weights(tmp_path: Path) -> None:
    """``training.precision: bf16``: the checkpoint's weights are fp32, near ``ddp``'s under
    autocast (within bf16's rounding over 9 steps), reduced in bf16 or fp32; under fp32,
    ``reduce_dtype: bf16`` rounds the reduced gradients (near fp32's, not equal)."""
    shape = (2, 2, [3, 4], 2 * 2 * 2 + 7)
    bf16 = {"training": {"precision": "bf16"}}
    ddp, *sharded, fp32, compressed = on_ranks(
        [
            config(tmp_path / "ddp", shape, **bf16),
            config(tmp_path / "bf16", shape, **bf16, strategy=fsdp()),
            config(tmp_path / "fp32", shape, **bf16, strategy=fsdp(reduce_dtype="fp32")),
            config(tmp_path / "ddp_fp32", shape),
            config(tmp_path / "compressed", shape, strategy=fsdp(reduce_dtype="bf16")),
        ]
    )
    for found in sharded:
        assert {t.dtype for t in found["state"]["model"].values()} == {torch.float32}
        assert_params_close(found["state"]["model"], ddp["state"]["model"], atol=2e-2)
    assert_params_close(compressed["state"]["model"], fp32["state"]["model"], atol=2e-2)
    with pytest.raises(AssertionError):
        assert_params_close(compressed["state"]["model"], fp32["state"]["model"], atol=1e-6)


def sharded_modules(ctx: RunContext, folder: Path, blocks: list[str]) -> list[str]:
    """The names of the modules ``fsdp`` with ``blocks`` shards (the root: ``""``)."""
    each = config(folder, (2, 2, [1, 2], 3), strategy=fsdp(blocks=blocks))
    model = fsdp_strategy(ctx, each).wrap(weighting_model())
    return [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("blocks", "expected"),
    [
        ([], ["", "0", "2"]),
        (["Linear"], ["", "0", "2"]),
        (["Tanh"], ["", "1"]),
        ([f"{Path(__file__).with_name('fsdp_factories.py')}:last_layer"], ["", "2"]),
    ],
)
def test_blocks_are_the_containers_children_or_as_named(
    tmp_path: Path, blocks: list[str], expected: list[str]
) -> None:
    assert run_ranks(sharded_modules, WORLD, tmp_path, blocks)[0] == expected


# ---------------------------------------------------------------------------------------------
# Evaluation


def evaluations(ctx: RunContext, folder: Path) -> dict[str, Any]:
    """Wrap the model under ``fsdp``, evaluate 3 batches on rank 0 and 1 on rank 1, then take
    a training step: the evaluations' outputs, and the gradients' norm after."""
    strategy = fsdp_strategy(ctx, config(folder, (2, 2, [1, 2], 3), strategy=fsdp()))
    model = strategy.wrap(weighting_model())
    outputs = []
    with strategy.evaluating(model), torch.no_grad():
        for _ in range(3 if ctx.rank == 0 else 1):
            outputs.append(model(torch.ones(1, 4)))
    model(torch.ones(2, 4)).sum().backward()
    return {"outputs": outputs, "norm": strategy.clip_grad_norm(model.parameters(), 1.0)}


def fsdp_strategy(ctx: RunContext, each: Config) -> Any:
    """The strategy ``each`` selects, as the engine builds it."""
    from ups.fsdp._fsdp import fsdp as build
    from ups.fsdp._options import FSDPOptions

    return build(ctx=ctx, config=each, options=FSDPOptions(**each.strategy.options))


def weighting_model(outputs: int = 2) -> nn.Module:
    """``weighting``'s model: ``Linear(4, 8)``, ``Tanh``, ``Linear(8, outputs)``."""
    return loaded(weighting.FACTORIES).build_model(outputs)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_ranks_evaluating_different_numbers_of_batches_run_no_collective(tmp_path: Path) -> None:
    """Rank 0 takes 3 forwards, rank 1 one (a collective inside would hang: the ranks would
    time out), with the outputs of the whole model; the backward after gathers as usual."""
    first, second = run_ranks(evaluations, WORLD, tmp_path, timeout_s=30)
    expected = weighting_model()(torch.ones(1, 4))
    for output in [*first["outputs"], *second["outputs"]]:
        torch.testing.assert_close(output, expected, rtol=0, atol=1e-6)
    model = weighting_model()
    model(torch.ones(2, 4)).sum().backward()
    norm = float(nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    assert first["norm"] == second["norm"] == pytest.approx(norm, abs=1e-5)


@pytest.mark.slow
def test_an_evaluation_of_uneven_shares_equals_ddps(tmp_path: Path) -> None:
    """5 evaluation samples in batches of 1 (3 on rank 0, 2 on rank 1) after every step: the
    same losses as ``ddp``'s, and the training after each goes on as ``ddp``'s."""
    evaluated = {"factory": f"{weighting.FACTORIES}:build_tuples", "options": {"n": 5}}
    each = {"eval": {**evaluated, "every_steps": 1, "batch_size": 1}}
    shape = (2, 2, [3, 4], 2 * 4 + 7)  # the last step: 2 micro-batches on each rank
    ddp, sharded = on_ranks(
        [
            config(tmp_path / "ddp", shape, **each),
            config(tmp_path / "fsdp", shape, **each, strategy=fsdp()),
        ]
    )
    assert len(ddp["evals"]) == len(sharded["evals"]) > 3
    for a, b in zip(ddp["evals"], sharded["evals"], strict=True):
        assert a["samples"] == b["samples"] == 5
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert_params_close(sharded["state"]["model"], ddp["state"]["model"], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Checkpoints

RESUMED = (2, 2, [3, 4], 2 * 2 * 2 * 2 + 7)
"""3 steps an epoch (9 in all) on 2 ranks of unequal counts."""


def resumable(folder: Path, max_steps: int | None, **sections: Any) -> Config:
    """A run of :data:`RESUMED` under ``fsdp`` (unless ``sections`` say) with an evaluation
    every 2 steps, going on from its latest checkpoint."""
    evaluated = {"factory": f"{weighting.FACTORIES}:build_tuples", "options": {"n": 5}}
    return config(
        folder,
        RESUMED,
        **{
            "strategy": fsdp(),
            "eval": {**evaluated, "every_steps": 2},
            "checkpoint": {"resume": "latest"},
            **sections,
            "training": {"max_steps": max_steps, **sections.get("training", {})},
        },
    )


@pytest.mark.slow
def test_a_checkpoint_resumes_bitwise_and_under_ddp_and_on_one_process(tmp_path: Path) -> None:
    """Saved at step 4 of 9 by 2 ranks under ``fsdp``: resumed so, the run ends as one that
    was not stopped, to the bit (model, optimizer); resumed under ``ddp``, to 1e-5; on
    one process, ``fsdp`` and ``ddp`` go on alike (to 1e-6)."""
    whole, stopped = on_ranks(
        [resumable(tmp_path / "whole", None), resumable(tmp_path / "parts", 4)]
    )
    assert stopped["state"]["step"] == 4
    for other in ("ddp", "one_fsdp", "one_ddp"):
        shutil.copytree(tmp_path / "parts", tmp_path / other)
    rest, under_ddp = on_ranks(
        [
            resumable(tmp_path / "parts", None),
            resumable(tmp_path / "ddp", None, strategy={"name": "ddp"}),
        ]
    )
    for key in ("model", "optimizer"):
        assert_bitwise_equal(rest["state"][key], whole["state"][key], key)
    assert rest["evals"][-1] == whole["evals"][-1]
    assert_params_close(under_ddp["state"]["model"], rest["state"]["model"], atol=1e-5)
    alone_sampler = {"name": "lopsided", "options": {"block": 4, "last": [7]}}
    one_fsdp, one_ddp = alone(
        [
            resumable(tmp_path / "one_fsdp", None, sampler=alone_sampler),
            resumable(tmp_path / "one_ddp", None, sampler=alone_sampler, strategy={"name": "ddp"}),
        ]
    )
    assert one_fsdp["state"]["step"] == one_ddp["state"]["step"] > 4
    assert_params_close(one_fsdp["state"]["model"], one_ddp["state"]["model"])


def ema_of_shards(ctx: RunContext, folder: Path, applied: bool) -> dict[str, Params]:
    """An ``EMA`` (decay 0.5) of the sharded model, updated after one SGD step: its averages
    and the weights before and after the step, full; with ``applied``, the model's weights
    inside ``ema.applied()`` instead of the averages."""
    strategy = fsdp_strategy(ctx, config(folder, (2, 2, [1, 2], 3), strategy=fsdp()))
    model = strategy.wrap(weighting_model())
    ema = EMA(model, decay=0.5)
    before = strategy.gathered(model.state_dict())
    model(torch.ones(2, 4)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    ema.update(1)
    after = strategy.gathered(model.state_dict())
    found = {"before": before, "after": after, "averages": strategy.gathered(ema.averaged())}
    if applied:
        with ema.applied():
            found["inside"] = strategy.gathered(model.state_dict())
        found["outside"] = strategy.gathered(model.state_dict())
        ema.reset()
        found["reset"] = strategy.gathered(ema.averaged())
    return found


@pytest.mark.slow
def test_an_ema_of_the_shards_averages_them(tmp_path: Path) -> None:
    found = run_ranks(ema_of_shards, WORLD, tmp_path, False)[0]
    expected = {k: (v + found["after"][k]) / 2 for k, v in found["before"].items()}
    assert_params_close(found["averages"], expected)
    assert not torch.equal(found["after"]["0.weight"], found["before"]["0.weight"])


@pytest.mark.slow
def test_an_ema_of_the_shards_is_applied_and_reset(tmp_path: Path) -> None:
    """Inside ``applied()`` the sharded model holds the averages, after it its own weights to
    the bit; ``reset()`` starts the averages from the weights (each rank copies its shards)."""
    found = run_ranks(ema_of_shards, WORLD, tmp_path, True)[0]
    assert_params_close(found["inside"], found["averages"], atol=0)
    assert_bitwise_equal(found["outside"], found["after"])
    assert_bitwise_equal(found["reset"], found["after"])


# ---------------------------------------------------------------------------------------------
# Memory


def parameter_bytes(ctx: RunContext, folder: Path) -> list[int]:
    """This rank's parameter bytes under ``fsdp``, then under ``ddp``."""
    each = config(folder, (2, 2, [1, 2], 3), strategy=fsdp())
    sharded = fsdp_strategy(ctx, each).wrap(weighting_model(outputs=9))
    whole = weighting_model(outputs=9)
    return [
        sum(_local(p).numel() * p.element_size() for p in m.parameters()) for m in (sharded, whole)
    ]


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, torch.distributed.tensor.DTensor) else param


@pytest.mark.slow
def test_each_rank_holds_about_half_the_parameters(tmp_path: Path) -> None:
    for sharded, whole in run_ranks(parameter_bytes, WORLD, tmp_path):
        assert sharded <= 0.55 * whole


def rank_weights(ctx: RunContext, folder: Path) -> dict[str, Params]:
    """Each rank's model made different (rank added to its weights), then wrapped: its own
    weights before, and the full ones after."""
    strategy = fsdp_strategy(ctx, config(folder, (2, 2, [1, 2], 3), strategy=fsdp()))
    model = weighting_model()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(ctx.rank)
    own = {k: v.clone() for k, v in model.state_dict().items()}
    return {"own": own, "wrapped": strategy.gathered(strategy.wrap(model).state_dict())}


@pytest.mark.slow
def test_every_rank_starts_from_rank_0s_weights(tmp_path: Path) -> None:
    """As DDP broadcasts rank 0's weights, so does ``fsdp`` before sharding them."""
    first, second = run_ranks(rank_weights, WORLD, tmp_path)
    assert_bitwise_equal(first["wrapped"], first["own"])
    assert_bitwise_equal(second["wrapped"], first["own"])


# ---------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize(
    ("sections", "key", "problem"),
    [
        (
            {"training": {"skip_oom": True}},
            "training.skip_oom",
            "cannot hold under strategy 'fsdp': a rank out of memory cannot skip a forward the "
            "other ranks gather parameters for; allowed: false, auto (off under it)",
        ),
        (
            {"strategy": fsdp(replicate=2)},
            "strategy.options.replicate",
            "2 groups do not divide the 1 ranks; allowed: a divisor of the number of ranks",
        ),
        (
            {"strategy": fsdp(cpu_offload=True)},
            "strategy.options.cpu_offload",
            "offloads from CUDA memory, and this run is on cpu; allowed: false",
        ),
        (
            {"strategy": fsdp(blocks=["Block"])},
            "strategy.options.blocks",
            "no module of the model is a 'Block'; its classes: Linear, Sequential, Tanh",
        ),
    ],
)
def test_what_fsdp_cannot_do_is_one_line_at_its_key(
    tmp_path: Path, sections: dict[str, Any], key: str, problem: str
) -> None:
    each = config(tmp_path, (2, 2, [3], 3), **{"strategy": fsdp(), **sections})
    with pytest.raises(ConfigError) as raised:
        alone([each])
    assert (raised.value.path, raised.value.problem) == (key, problem)
