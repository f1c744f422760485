"""Every sample of an optimizer step weighs the same, on real process groups: micro-batches of
unequal sizes, ranks of unequal counts and losses over counted items train as one process over
the step's samples does (to 1e-6 in fp32), and the weighing costs no collective where every
rank's count is known (one per step where it is not)."""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import attrs
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Sampler

from ups.core import (
    Config,
    RunContext,
    SamplerPlugin,
    StepError,
    Strategy,
    StrategyPlugin,
    config_from_mapping,
    hookimpl,
)
from ups.core.engine import train_rank
from ups.core.engine._update import Stepper
from ups.core.plugin._manager import AUTOLOAD_ENV, load_plugins
from ups.core.testing import assert_params_close, read_checkpoint, run_ranks

FACTORIES = Path(__file__).resolve().with_name("weighing_factories.py")
"""The model, data and steps of the runs here."""
WORLD = 2
TOKENS = 4
"""The outputs :class:`weighing_factories.TokenStep`'s model needs."""

Params = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# A sampler whose ranks get unequal counts


@attrs.frozen
class LopsidedOptions:
    block: int
    """Samples of a rank in a step but the epoch's last: ``batch_size x accumulation_steps``."""
    last: tuple[int, ...]
    """Each rank's samples in the epoch's last step."""


class Lopsided(Sampler[int]):
    """A training sampler whose ranks get unequal counts (``even`` is not declared): each
    epoch's permutation of the samples, step by step, ``block`` to each rank in turn, then the
    rest, ``last[rank]`` to each. Over one process (``last`` summed, ``block`` times the ranks)
    a step takes the samples the ranks take together."""

    def __init__(self, dataset: Any, *, ctx: RunContext, seed: int, options: LopsidedOptions):
        self.size, self.rank, self.seed = len(dataset), ctx.rank, seed
        self.block, self.last = options.block, options.last
        full = self.size - sum(self.last)
        assert len(self.last) == ctx.world_size and full % (ctx.world_size * self.block) == 0
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return (self.size - sum(self.last)) // len(self.last) + self.last[self.rank]

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator).tolist()
        ranks = len(self.last)
        end = self.size - sum(self.last)
        for start in range(0, end, ranks * self.block):
            yield from order[start + self.rank * self.block :][: self.block]
        yield from order[end + sum(self.last[: self.rank]) :][: self.last[self.rank]]


class RescaledAfter(Strategy):
    """DDP, weighing as a strategy that cannot reach the accumulated gradients before the
    synchronising backward does (FSDP): every micro-batch alike, the reduced gradients
    rescaled after it (:meth:`~ups.core.engine._update.Weights.after`)."""

    reweighs = False


LOPSIDED = types.SimpleNamespace(
    ups_samplers=hookimpl(
        lambda: [SamplerPlugin(name="lopsided", factory=Lopsided, options=LopsidedOptions)]
    ),
    ups_strategies=hookimpl(
        lambda: [
            StrategyPlugin(
                name="after",
                factory=lambda *, ctx, config, options: RescaledAfter(ctx, config),
            )
        ]
    ),
)


# ---------------------------------------------------------------------------------------------
# Runs


def config(folder: Path, batch: int, accumulation: int, samples: int, /, **sections: Any) -> Config:
    """A config training :func:`build_model` on ``samples`` tuples for 3 epochs with SGD (whose
    updates, unlike Adam's, follow the gradients' scale), sections updated key by key."""
    mapping: dict[str, Any] = {
        "run": {"name": "weighted", "output_dir": str(folder), "log_every": 1000},
        "model": {"factory": f"{FACTORIES}:build_model"},
        "data": {"factory": f"{FACTORIES}:build_tuples", "options": {"n": samples}},
        "training": {
            "epochs": 3,
            "batch_size": batch,
            "accumulation_steps": accumulation,
            "lr": 0.1,
            "optimizer": "sgd",
        },
        "sampler": {"name": "torch", "options": {"shuffle": True}},
    }
    for name, values in sections.items():
        mapping[name] = {**mapping.get(name, {}), **values}
    return config_from_mapping(mapping)


def registry() -> Any:
    """The built-in plugins and the :class:`Lopsided` sampler, no installed plugin."""
    return load_plugins(extra=[("lopsided", LOPSIDED)], env={AUTOLOAD_ENV: "1"})


def final_params(ctx: RunContext, configs: list[Config]) -> list[Params]:
    """Train each config in turn on this rank; the model of each run's final checkpoint."""
    found = []
    for each in configs:
        result = train_rank(each, ctx, registry())
        assert result.checkpoint is not None
        found.append(read_checkpoint(result.checkpoint)["state"]["model"])
    return found


def on_ranks(configs: list[Config]) -> list[Params]:
    """:func:`final_params` on ``WORLD`` ranks (rank 0's: the model is the same on all)."""
    return run_ranks(final_params, WORLD, configs)[0]


def alone(configs: list[Config]) -> list[Params]:
    """:func:`final_params` in this process, one rank."""
    return final_params(RunContext(), configs)


def assert_close(found: list[Params], expected: list[Params]) -> None:
    assert len(found) == len(expected)
    for a, b in zip(found, expected, strict=True):
        assert_params_close(a, b)


@st.composite
def uneven_steps(draw: st.DrawFn) -> tuple[int, int, int]:
    """``(batch, accumulation, samples)`` such that each of ``WORLD`` ranks ends every epoch
    with a step of micro-batches of unequal sizes (a full one, then a short one)."""
    batch = draw(st.integers(2, 6))
    accumulation = draw(st.integers(2, 4))
    full = draw(st.integers(0, 2))
    last = draw(st.integers(batch + 1, batch * accumulation - 1).filter(lambda n: n % batch))
    return batch, accumulation, WORLD * (full * batch * accumulation + last)


@pytest.mark.slow
@settings(max_examples=3, deadline=None)
@given(shape=uneven_steps())
def test_micro_batches_of_unequal_sizes_weigh_every_sample_once(
    tmp_path_factory: pytest.TempPathFactory, shape: tuple[int, int, int]
) -> None:
    """2 ranks of ``k`` micro-batches of ``b`` ≡ one process of ``2kb``, the epoch's last step
    split unevenly; the built-in step on tuples, and a step of one's own on dicts, clipped,
    with ``static_graph``."""
    batch, accumulation, samples = shape
    folder = tmp_path_factory.mktemp("uneven")
    own = {
        "step": {"factory": f"{FACTORIES}:DictStep"},
        "data": {"factory": f"{FACTORIES}:build_dicts", "options": {"n": samples}},
    }
    clipped = {"training": {"grad_clip_norm": 0.3}}
    both = {"distributed": {"static_graph": True, "gradient_as_bucket_view": True}}
    ranks = on_ranks(
        [
            config(folder / "a", batch, accumulation, samples),
            config(folder / "b", batch, accumulation, samples, **own, **clipped, **both),
        ]
    )
    big = {"batch_size": WORLD * batch * accumulation, "accumulation_steps": 1}
    one = alone(
        [
            config(folder / "c", batch, accumulation, samples, training=big),
            config(
                folder / "d",
                batch,
                accumulation,
                samples,
                **own,
                training={**big, "grad_clip_norm": 0.3},
            ),
        ]
    )
    assert_close(ranks, one)


@st.composite
def lopsided_steps(draw: st.DrawFn) -> tuple[int, int, list[int], int]:
    """``(batch, accumulation, last, samples)``: full steps, then an epoch's last step of
    ``last[rank]`` samples, unequal, in the same number of micro-batches on every rank."""
    batch = draw(st.integers(2, 6))
    accumulation = draw(st.integers(1, 3))
    full = draw(st.integers(0, 2))
    batches = draw(st.integers(1, accumulation))
    short = st.lists(st.integers(1, batch), min_size=WORLD, max_size=WORLD, unique=True)
    last = [(batches - 1) * batch + n for n in draw(short)]
    return batch, accumulation, last, WORLD * full * batch * accumulation + sum(last)


@pytest.mark.slow
@settings(max_examples=3, deadline=None)
@given(shape=lopsided_steps())
def test_ranks_of_unequal_counts_weigh_every_sample_once(
    tmp_path_factory: pytest.TempPathFactory, shape: tuple[int, int, list[int], int]
) -> None:
    """A sampler that gives the ranks unequal counts (not ``even``) ≡ one process over the
    same samples; the ranks' counts summed by an all-reduce of their own, or by the step's
    agreement (``training.skip_oom``); and under a strategy that rescales the reduced
    gradients after the synchronising backward."""
    batch, accumulation, last, samples = shape
    folder = tmp_path_factory.mktemp("lopsided")
    options = {"block": batch * accumulation, "last": last}
    lopsided = {"sampler": {"name": "lopsided", "options": options}}
    after = {"strategy": {"name": "after"}}
    ranks = on_ranks(
        [
            config(folder / "a", batch, accumulation, samples, **lopsided),
            config(
                folder / "b", batch, accumulation, samples, **lopsided, training={"skip_oom": True}
            ),
            config(folder / "e", batch, accumulation, samples, **lopsided, **after),
        ]
    )
    whole = {"block": WORLD * batch * accumulation, "last": [sum(last)]}
    big = {"batch_size": WORLD * batch * accumulation, "accumulation_steps": 1}
    one = config(
        folder / "c",
        batch,
        accumulation,
        samples,
        sampler={"name": "lopsided", "options": whole},
        training=big,
    )
    assert_close(ranks, alone([one]) * 3)


@st.composite
def token_steps(draw: st.DrawFn) -> tuple[int, int, int]:
    """``(batch, accumulation, samples)`` of any split, the last step's too."""
    batch = draw(st.integers(2, 6))
    accumulation = draw(st.integers(1, 3))
    return batch, accumulation, WORLD * draw(st.integers(batch + 1, 3 * batch * accumulation))


@pytest.mark.slow
@settings(max_examples=3, deadline=None)
@given(shape=token_steps())
def test_a_mean_over_counted_items_weighs_every_item_once(
    tmp_path_factory: pytest.TempPathFactory, shape: tuple[int, int, int]
) -> None:
    """``(mean, count)`` losses whose counts differ from micro-batch to micro-batch and rank
    to rank ≡ one process's mean over the step's items; the counts summed by an all-reduce
    of their own, or by the step's agreement (``training.skip_oom``)."""
    batch, accumulation, samples = shape
    folder = tmp_path_factory.mktemp("tokens")
    tokens = {
        "step": {"factory": f"{FACTORIES}:TokenStep"},
        "model": {"options": {"outputs": TOKENS}},
        "data": {"factory": f"{FACTORIES}:build_dicts", "options": {"n": samples}},
    }
    ranks = on_ranks(
        [
            config(folder / "a", batch, accumulation, samples, **tokens),
            config(
                folder / "b", batch, accumulation, samples, **tokens, training={"skip_oom": True}
            ),
            config(
                folder / "e", batch, accumulation, samples, **tokens, strategy={"name": "after"}
            ),
        ]
    )
    big = {"batch_size": WORLD * batch * accumulation, "accumulation_steps": 1}
    one = config(folder / "c", batch, accumulation, samples, **tokens, training=big)
    assert_close(ranks, alone([one]) * 3)


# ---------------------------------------------------------------------------------------------
# What the weighing costs


def all_reduces_per_step(ctx: RunContext, configs: list[Config]) -> list[list[int]]:
    """Train each config on this rank, counting the ``torch.distributed.all_reduce`` calls
    each optimizer step makes (DDP's gradient buckets are not such calls)."""
    calls = 0
    original_all_reduce, original_step = dist.all_reduce, Stepper.step

    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return original_all_reduce(*args, **kwargs)

    def step(stepper: Stepper, *args: Any) -> Any:
        before = calls
        taken = original_step(stepper, *args)
        counts[-1].append(calls - before)
        return taken

    counts: list[list[int]] = []
    with (
        mock.patch.object(dist, "all_reduce", all_reduce),
        mock.patch.object(Stepper, "step", step),
    ):
        for each in configs:
            counts.append([])
            train_rank(each, ctx, registry())
    return counts


@pytest.mark.slow
def test_the_weighing_adds_no_collective_where_counts_are_known_and_one_where_not(
    tmp_path: Path,
) -> None:
    """Per-sample losses from an even sampler, and 0-d means: none; ``(mean, count)``, or an
    uneven sampler: one all-reduce a step; with ``training.skip_oom``, none either way: the
    step's agreements carry the counts (one before the last micro-batch, one after)."""
    samples = 52  # batches of 4, 3 micro-batches a step: a rank's are 4 4 4 | 4 4 4 | 2
    dicts = {"data": {"factory": f"{FACTORIES}:build_dicts", "options": {"n": samples}}}
    tokens = {
        "step": {"factory": f"{FACTORIES}:TokenStep"},
        "model": {"options": {"outputs": TOKENS}},
    }
    lopsided = {
        "sampler": {"name": "lopsided", "options": {"block": 12, "last": [2, 4]}},
        "data": {"factory": f"{FACTORIES}:build_tuples", "options": {"n": 2 * 24 + 6}},
    }
    agreeing = {"training": {"skip_oom": True}}
    counts = run_ranks(
        all_reduces_per_step,
        WORLD,
        [
            config(tmp_path / "samples", 4, 3, samples),
            config(
                tmp_path / "mean", 4, 3, samples, **dicts, step={"factory": f"{FACTORIES}:MeanStep"}
            ),
            config(tmp_path / "tokens", 4, 3, samples, **dicts, **tokens),
            config(tmp_path / "lopsided", 4, 3, samples, **lopsided),
            config(tmp_path / "agreed", 4, 3, samples, **agreeing),
            config(tmp_path / "agreed_tokens", 4, 3, samples, **dicts, **tokens, **agreeing),
        ],
    )[0]
    agreed = [2, 2, 1] * 3  # a step of one micro-batch agrees once
    assert counts == [[0] * 9, [0] * 9, [1] * 9, [1] * 9, agreed, agreed]


def test_a_step_returning_two_kinds_of_loss_is_named(tmp_path: Path) -> None:
    mixed = config(  # micro-batches of 4 and 2 samples: one step
        tmp_path,
        4,
        2,
        6,
        step={"factory": f"{FACTORIES}:MixedStep"},
        data={"factory": f"{FACTORIES}:build_dicts", "options": {"n": 6}},
    )
    expected = (
        r"^at step 1: step\.factory: MixedStep\.loss returned a 0-d mean for a micro-batch and "
        r"one loss per sample for another of the same step; return one kind of loss for every "
        r"batch$"
    )
    with pytest.raises(StepError, match=expected):
        alone([mixed])
