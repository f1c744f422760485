"""The modules of ``ups.core`` kept at their former names (``batches``, ``schedule``,
``builtins``, ``arguments``) and ``ups.core.engine.train`` give the very objects of their new
homes, so code written against the flat ``ups.core`` goes on working."""

from __future__ import annotations

import importlib

import pytest

from ups.core import engine

SHIMS = {
    "ups.core.batches": "ups.core.engine",
    "ups.core.schedule": "ups.core.engine",
    "ups.core.builtins": "ups.core.plugin",
    "ups.core.arguments": "ups.core.config",
}


@pytest.mark.parametrize(("shim", "home"), SHIMS.items())
def test_a_former_module_gives_its_new_homes_objects(shim: str, home: str) -> None:
    former, new = importlib.import_module(shim), importlib.import_module(home)
    assert former.__all__
    for name in former.__all__:
        assert getattr(former, name) is getattr(new, name), name


def test_the_engines_train_is_train_rank() -> None:
    assert engine.train is engine.train_rank
