"""A factory's module or file that fails to import is one line naming the key, the file and
line, and the error (exit 2, the traceback under UPS_TRACEBACK); a factory file imports the
files beside it, in ``ups validate`` and on the ranks alike, from any working directory."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from conftest import Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ups.core import ConfigError
from ups.core.config._user_code import TRACEBACK_ENV, load_object
from ups.core.testing import events, run_ups, tiny_project

BROKEN = {
    # file text, the line it fails at, the error as the message ends
    "syntax": ("import torch\n\ndef build(:\n", 3, "SyntaxError: invalid syntax"),
    "raises": ("x = 1\nraise RuntimeError('no GPU here')\n", 2, "RuntimeError: no GPU here"),
    "missing": (
        "import os\nimport no_such_package_ups\n",
        2,
        f"ModuleNotFoundError: No module named 'no_such_package_ups' (is it installed for "
        f"{sys.executable}?)",
    ),
    "exits": (
        "import sys\nsys.exit(2)\n",
        2,
        "SystemExit: 2 (the file exits when imported: put its script under "
        "if __name__ == '__main__':)",
    ),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_file_that_fails_to_import_is_named_with_its_line(tmp_path: Path, kind: str) -> None:
    text, line, error = BROKEN[kind]
    path = tmp_path / "model.py"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_object(f"{path}:build", "model.factory")
    assert str(caught.value) == f"model.factory: importing {path} failed at line {line}: {error}"
    assert caught.value.__cause__ is not None  # the traceback, for UPS_TRACEBACK and rank logs


def test_an_error_in_a_file_it_imports_names_that_file(tmp_path: Path) -> None:
    helper = f"helper_{uuid.uuid4().hex}"
    (tmp_path / f"{helper}.py").write_text("import torch\n\ntorch.zeros(2).view(3)\n")
    (tmp_path / "model.py").write_text(f"import {helper}\n")
    with pytest.raises(ConfigError) as caught:
        load_object(f"{tmp_path / 'model.py'}:build", "model.factory")
    # The user's line, not torch's where it raised.
    assert str(caught.value) == (
        f"model.factory: importing {tmp_path / 'model.py'} failed at {tmp_path / helper}.py, "
        "line 3: RuntimeError: shape '[3]' is invalid for input of size 2"
    )


def test_a_module_that_fails_inside_is_named_with_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = f"pkg_{uuid.uuid4().hex}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "models.py").write_text("import no_such_package_ups\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as caught:
        load_object(f"{package}.models:build", "step.factory")
    assert str(caught.value).startswith(
        f"step.factory: importing '{package}.models' failed at "
        f"{tmp_path / package / 'models.py'}, line 1: ModuleNotFoundError: No module named "
    )
    with pytest.raises(ConfigError, match=rf"^step\.factory: cannot import '{package}\.nope': "):
        load_object(f"{package}.nope:build", "step.factory")  # missing itself: as before


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(blank=st.integers(0, 40), words=st.text(st.characters(categories=["L", "N"]), max_size=20))
def test_the_line_named_is_the_one_that_raised(tmp_path: Path, blank: int, words: str) -> None:
    path = tmp_path / f"m_{uuid.uuid4().hex}.py"
    path.write_text("\n" * blank + f"raise ValueError({words!r})\n")
    with pytest.raises(ConfigError) as caught:
        load_object(f"{path}:f", "data.factory")
    error = "ValueError" + (f": {words}" if words else "")
    assert (
        str(caught.value) == f"data.factory: importing {path} failed at line {blank + 1}: {error}"
    )


def broken_project(folder: Path, key: str) -> Path:
    """A tiny project whose ``key`` names ``broken.py``, which raises on line 2."""
    config = tiny_project(folder)
    (folder / "broken.py").write_text("import torch\nraise RuntimeError('boom')\n")
    data = yaml.safe_load(config.read_text())
    section, name = key.split(".")
    data.setdefault(section, {})[name] = "broken.py:build"
    config.write_text(yaml.safe_dump(data))
    return config


@pytest.mark.parametrize("key", ["model.factory", "data.factory", "step.factory"])
def test_ups_validate_and_train_say_one_line_and_exit_2(
    tmp_path: Path, key: str, ups: Callable[..., Result]
) -> None:
    config = broken_project(tmp_path, key)
    line = f"ups: error: {key}: importing {tmp_path / 'broken.py'} failed at line 2: "
    for command in ("validate", "train"):
        result = ups(command, str(config))
        assert result.returncode == 2
        assert result.stderr == line + "RuntimeError: boom\n"


def test_ups_traceback_prints_the_traceback_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = broken_project(tmp_path, "model.factory")
    result = run_ups("validate", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    result = run_ups("validate", str(config))
    assert result.returncode == 2
    assert result.stderr.startswith("Traceback (most recent call last):\n")
    assert f'File "{tmp_path / "broken.py"}", line 2, in <module>' in result.stderr
    assert result.stderr.endswith("failed at line 2: RuntimeError: boom\n")


SIBLING_MODEL = """
from helpers import Dataset, Model  # the file beside this one


def build_model():
    return Model()


def build_dataset(n=64):
    return Dataset(n)
"""
HELPERS = """
import torch
from torch import nn


class Model(nn.Sequential):
    def __init__(self):
        torch.manual_seed(0)
        super().__init__(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


class Dataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.x[i].sum(0, keepdim=True)
"""


def test_a_factory_file_imports_the_files_beside_it_from_any_folder(tmp_path: Path) -> None:
    """``ups validate`` (the agent) and the ranks (``python -m ups.core``, their working
    directory elsewhere) import ``helpers.py`` beside ``model.py``."""
    project = tmp_path / "project"
    config = tiny_project(
        project,
        model={"factory": "model.py:build_model"},
        data={"factory": "model.py:build_dataset"},
        run={"name": "siblings", "output_dir": str(tmp_path / "runs")},
    )
    (project / "model.py").write_text(SIBLING_MODEL)
    (project / "helpers.py").write_text(HELPERS)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    validated = run_ups("validate", str(config), cwd=elsewhere)
    assert validated.returncode == 0, validated.stderr
    trained = run_ups("train", str(config), "--nproc", "2", cwd=elsewhere, timeout=300)
    assert trained.returncode == 0, trained.stderr
    logged = events(trained.stderr)
    assert logged[-1]["event"] == "done" and logged[-1]["steps"] == 4
