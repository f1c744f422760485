"""What passed ``ups validate`` and failed on the ranks is refused before training, naming the
key: numbers no consumer takes (any int or float option), SyncBatchNorm on CPU ranks, built-in
step options that are not places in a batch; the built-in step reaches nested keys by a path,
and a model output or target its loss by name cannot take is named, not a raw AttributeError."""

from __future__ import annotations

import functools
import math
import operator
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import yaml
from conftest import Result
from hypothesis import given
from hypothesis import strategies as st

from ups.core import Config, ConfigError, Step, StepError, load_config, load_plugins, train
from ups.core.config._structure import INT_BOUND, structure
from ups.core.config._validate import validate
from ups.core.engine._step import pick
from ups.core.testing import run_ups, tiny_project

# --- numbers -------------------------------------------------------------------------------


def number_fields(cls: type, path: str = "") -> Iterator[tuple[str, type]]:
    """Every ``int`` and ``float`` key of ``cls`` and the sections in it, with its type."""
    hints = typing.get_type_hints(cls)
    for field in attrs.fields(cls):
        key, tp = f"{path}{field.name}", hints[field.name]
        options = typing.get_args(tp) if typing.get_origin(tp) is types.UnionType else (tp,)
        for option in options:
            if attrs.has(option):
                yield from number_fields(option, f"{key}.")
            elif option in (int, float):
                yield key, option


NUMBER_FIELDS = sorted(number_fields(Config))
BASE = {"model": {"factory": "m.py:f"}, "data": {"factory": "m.py:f"}}


def config_with(key: str, value: object) -> dict[str, Any]:
    """:data:`BASE` with ``key`` (a dotted path) set to ``value``, and the sections on its way
    that need a factory given one."""
    data: dict[str, Any] = yaml.safe_load(yaml.safe_dump(BASE))
    node = data
    *sections, name = key.split(".")
    for section in sections:
        node = node.setdefault(section, {"factory": "m.py:f"} if section == "eval" else {})
    node[name] = value
    return data


def test_every_number_key_of_the_config_is_found() -> None:
    keys = dict(NUMBER_FIELDS)
    assert keys["training.lr"] is float and keys["training.batch_size"] is int
    assert keys["distributed.timeout_s"] is float and keys["eval.every_steps"] is int
    assert len(keys) > 20


@given(
    field=st.sampled_from(NUMBER_FIELDS),
    beyond=st.one_of(st.integers(min_value=INT_BOUND), st.integers(max_value=-INT_BOUND - 1)),
    infinite=st.sampled_from([math.nan, math.inf, -math.inf]),
)
def test_no_number_key_takes_what_no_consumer_takes(
    field: tuple[str, type], beyond: int, infinite: float
) -> None:
    """Any int key refuses an int beyond 64 bits, any float key a float that is not finite (or
    an int beyond any float), naming the key: one rule for every key, plugins' sections too."""
    key, tp = field
    bad = [infinite, 10**400] if tp is float else [beyond]
    for value in bad:
        with pytest.raises(ConfigError, match="is not allowed: must be ") as caught:
            structure(Config, config_with(key, value))
        assert caught.value.path == key


def test_a_factorys_options_pass_on_infinity_as_they_are() -> None:
    config = structure(Config, config_with("model.options", {"max_norm": math.inf}))
    assert config.model.options == {"max_norm": math.inf}


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("training.lr=.nan", "training.lr: .nan is not allowed: must be a finite number"),
        ("training.lr=.inf", "training.lr: .inf is not allowed: must be a finite number"),
        ("training.lr=1e999", "training.lr: .inf is not allowed: must be a finite number"),
        (
            "training.grad_clip_norm=-.inf",
            "training.grad_clip_norm: -.inf is not allowed: must be a finite number",
        ),
        (
            "training.batch_size=99999999999999999999999",
            "training.batch_size: 99999999999999999999999 is not allowed: must be <= "
            "9223372036854775807 (64 bits)",
        ),
        (
            "distributed.timeout_s=1e300",
            "distributed.timeout_s: 1e+300 is not allowed: must be <= 1e+09",
        ),
        (
            "distributed.bucket_cap_mb=1e13",
            "distributed.bucket_cap_mb: 10000000000000.0 is not allowed: must be <= 1e+12",
        ),
    ],
)
def test_ups_validate_refuses_numbers_the_ranks_cannot_take(
    project: Path, ups: Callable[..., Result], override: str, line: str
) -> None:
    config = project / "run.yaml"
    result = ups("validate", str(config), "-o", override)
    assert (result.returncode, result.stderr) == (2, f"ups: error: {config}: {line}\n")


# --- SyncBatchNorm -------------------------------------------------------------------------

CPU_RANKS = "SyncBatchNorm runs on CUDA only (DDP refuses it on the CPU)"


def test_sync_batchnorm_on_cpu_ranks_is_refused(project: Path, ups: Callable[..., Result]) -> None:
    config = str(project / "run.yaml")
    sync = ("-o", "distributed.sync_batchnorm=true")
    result = ups("validate", config, "--nproc", "2", *sync, "-o", "distributed.backend=gloo")
    assert result.returncode == 2
    assert result.stderr == (
        f"ups: error: distributed.sync_batchnorm: {CPU_RANKS}, and distributed.backend 'gloo' "
        "puts every rank on the CPU; allowed here: false (GroupNorm or LayerNorm normalise "
        "alike on any number of ranks)\n"
    )
    assert ups("validate", config, *sync).returncode == 0  # one process: nothing converted


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="2 CUDA devices put no rank on CPU")
def test_ups_train_with_sync_batchnorm_on_cpu_says_one_line(project: Path) -> None:
    result = run_ups(
        "train", str(project / "run.yaml"), "--nproc", "2", "-o", "distributed.sync_batchnorm=true"
    )
    assert result.returncode == 2
    assert result.stderr.startswith(f"ups: error: distributed.sync_batchnorm: {CPU_RANKS}, and ")
    assert len(result.stderr.splitlines()) == 1


# --- the built-in step ---------------------------------------------------------------------

NESTED = """
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset


class Nested(Dataset):
    def __init__(self, n=64):
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        y = self.x[i].sum(0, keepdim=True)
        return {"inputs": {"field": self.x[i]}, "labels": {"y": y, "names": ["a", "b"]}}


def build_dataset(n=64):
    return Nested(n)


@dataclass
class Output:
    prediction: torch.Tensor


class Model(nn.Module):
    def __init__(self, dataclass=False):
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.dataclass = nn.Linear(4, 1), dataclass

    def forward(self, field):
        y = self.linear(field)
        return Output(y) if self.dataclass else y


def build_model(dataclass=False):
    return Model(dataclass)


def not_a_function():
    return 3
"""
PATHS = {"inputs": {"field": ["inputs", "field"]}, "target": ["labels", "y"], "task": None}


def nested_project(folder: Path, **sections: dict[str, Any]) -> Path:
    """A tiny project of nested dict batches, which the built-in step reaches by paths; each
    keyword updates that section key by key."""
    defaults: dict[str, dict[str, Any]] = {
        "model": {"factory": "nested.py:build_model"},
        "data": {"factory": "nested.py:build_dataset"},
        "step": {"options": PATHS},
    }
    for name, values in sections.items():
        defaults[name] = {**defaults.get(name, {}), **values}
    config = tiny_project(folder, **defaults)
    (folder / "nested.py").write_text(NESTED)
    return config


def test_the_built_in_step_reaches_nested_keys_by_a_path(tmp_path: Path) -> None:
    config = nested_project(tmp_path)
    validate(load_config(config), load_plugins())
    result = train(config)
    assert result.steps == 8 and all(map(math.isfinite, result.losses))


nested_values: st.SearchStrategy[Any] = st.recursive(
    st.integers(),
    lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=3), children, min_size=1, max_size=3),
    ),
    max_leaves=12,
)


@given(batch=nested_values, data=st.data())
def test_a_path_picks_what_indexing_step_by_step_gives(batch: Any, data: st.DataObject) -> None:
    path, node = [], batch
    while isinstance(node, tuple | dict) and data.draw(st.booleans()):
        key = data.draw(
            st.sampled_from(range(len(node)) if isinstance(node, tuple) else list(node))
        )
        path.append(key)
        node = node[key]
    if path:
        assert pick(batch, path, "step.target") == functools.reduce(operator.getitem, path, batch)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        (
            "inputs",
            {"field": ["inputs", ["field"]]},
            r"^step\.options\.inputs\.field\[1\]: \['field'\] is not an index or a key, and a "
            r"list of them is a path into nested batches \(\[inputs, field\]: ",
        ),
        (
            "target",
            ["labels", ["y"]],
            r"^step\.options\.target\[1\]: \['y'\] is not an index or a key",
        ),
        ("target", [], r"^step\.options\.target: \[\] is not a place in the batch: an index "),
        ("target", True, r"^step\.options\.target: True is not a place in the batch"),
        ("task", {"a": "b"}, r"^step\.options\.task: \{'a': 'b'\} is not a place in the batch"),
        ("inputs", {1: "x"}, r"^step\.options\.inputs: the keyword 1 is not a string$"),
        ("criterion", 5, r"^step\.criterion: 5 is not a loss; allowed: mse, l1, cross_entropy"),
    ],
)
def test_built_in_step_options_that_are_no_place_are_refused_by_validate(
    tmp_path: Path, option: str, value: Any, message: str
) -> None:
    config = nested_project(tmp_path, step={"options": {**PATHS, option: value}})
    with pytest.raises(ConfigError if option != "criterion" else StepError, match=message):
        validate(load_config(config), load_plugins())


def test_a_metrics_factory_returning_no_function_is_refused(tmp_path: Path) -> None:
    config = nested_project(tmp_path, metrics={"factory": "nested.py:not_a_function"})
    with pytest.raises(ConfigError, match=r"^metrics\.factory: returned an int, not a function"):
        validate(load_config(config), load_plugins())


OWN = "or compute the loss in a Step of your own (override loss; step.factory)"


def test_a_model_output_the_loss_by_name_cannot_take_is_named(tmp_path: Path) -> None:
    config = nested_project(tmp_path, model={"options": {"dataclass": True}})
    expected = (
        "at step 1: training.loss: 'mse' takes tensors, and the model (model.factory) returned "
        f"an Output; return a tensor from its forward, {OWN}"
    )
    with pytest.raises(StepError) as caught:
        train(config)
    assert str(caught.value) == expected
    for loss in ("l1", "cross_entropy"):  # every loss by name, the fused mean's or not
        with pytest.raises(StepError, match=rf"training\.loss: '{loss}' takes tensors, and the"):
            train(config, overrides=[f"training.loss={loss}", f"run.name={loss}"])


def test_a_target_the_loss_by_name_cannot_take_is_named(tmp_path: Path) -> None:
    config = nested_project(tmp_path, step={"options": {**PATHS, "target": ["labels", "names"]}})
    with pytest.raises(StepError) as caught:
        train(config)
    assert str(caught.value) == (
        "at step 1: training.loss: 'mse' takes tensors, and the batch's target (step.target) is "
        "a list; point step.options.target at a tensor (a list of keys is a path into nested "
        f"batches: [labels, y]), {OWN}"
    )


def test_a_step_object_takes_paths_from_python_too() -> None:
    step = Step(inputs=[("x", 0)], target=("y", "z"), task=None)
    batch = {"x": (torch.ones(3, 2),), "y": {"z": torch.zeros(3, 1)}}
    outputs = step.forward(torch.nn.Linear(2, 1), batch)
    assert step.loss(outputs, batch).shape == (3,)  # type: ignore[union-attr]


def test_ups_train_on_two_ranks_names_the_models_output(tmp_path: Path) -> None:
    config = nested_project(tmp_path, model={"options": {"dataclass": True}})
    result = run_ups("train", str(config), "--nproc", "2", timeout=300)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("ups: ")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ups: rank ")
    assert (
        "training.loss: 'mse' takes tensors, and the model (model.factory) returned an "
        in (lines[0])
    )
