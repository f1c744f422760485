"""A user installs one distribution into a fresh venv, from its folder, with ups-dist-core's
folder beside it (every distribution asks for ups-dist-core by name; it is not published):
torch comes along, nothing of the other ups distributions does. A contributor installs every
distribution and plugin editable into one venv with the README's one command."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UPS = {
    "ups-dist-core",
    "ups-samplers",
    "ups-ckpt",
    "ups-comm-hooks",
    "ups-cloud",
    "ups-blocks",
    "ups-tensorboard",
    "ups-optuna",
    "ups-mlflow",
    "ups-wandb",
}
"""Every distribution of this repository."""
CORE_ROW = ["sampler", "torch", "ups-dist-core", "ups-dist-core", "0.1.0", "enabled"]
PLUGINS = (
    "from ups.core import load_plugins\n"
    "for p in load_plugins().plugins: print(p.name, p.distribution, p.status)"
)
"""Prints each plugin ``ups`` finds (its entry point loaded, or failed), with its status."""
ALONE = {
    "ups-samplers": ["packages/ups-dist-core", "packages/ups-samplers"],
    "ups-blocks": ["packages/ups-dist-core", "plugins/ups-blocks"],
    "ups-tensorboard": ["packages/ups-dist-core", "plugins/ups-tensorboard"],
    "ups-mlflow": ["packages/ups-dist-core", "plugins/ups-mlflow"],
    "ups-wandb": ["packages/ups-dist-core", "plugins/ups-wandb"],
}
"""Each distribution installed alone (with ups-dist-core's folder beside it), by name."""
DEVELOP = "develop"
"""The contributor's venv: ``pip install -r requirements-dev.txt``."""


def run(*args: str | Path, cwd: Path) -> str:
    result = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=900, cwd=cwd
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def _install(venv: Path, name: str) -> Path:
    """A fresh venv at ``venv`` with ``name`` installed: one of :data:`ALONE` from its
    folders, or :data:`DEVELOP`. torch is pinned to the build on this machine's disk (the
    distributions ask for any torch >= 2.2), the rest by the constraints nox installs with,
    so that pip resolves at once."""
    run(sys.executable, "-m", "venv", venv, cwd=ROOT)
    pip: list[str | Path] = [venv / "bin" / "python", "-m", "pip", "install", "-q"]
    pip += ["-c", ROOT / "constraints-ci.txt"]
    if name == DEVELOP:
        run(*pip, "-r", "requirements-dev.txt", cwd=ROOT)
    else:
        run(*pip, "torch==2.13.0", *(ROOT / folder for folder in ALONE[name]), cwd=ROOT)
    return venv


_POOL = ThreadPoolExecutor(len(ALONE) + 1)
_BUILT: dict[str, Future[Path]] = {}
_ROOTS: list[Path] = []


def start_installs() -> dict[str, Future[Path]]:
    """Start building every venv of this module (once), each in a new temporary folder.

    tests/conftest.py calls it as soon as these tests are collected: pip spends most of its
    time waiting on downloads and disks, so the six installs build beside the tests that run
    first, and beside each other. A venv's ``result()`` is its folder, or raises what failed."""
    if not _BUILT:
        root = Path(tempfile.mkdtemp(prefix="ups-install-"))
        _ROOTS.append(root)
        for name in [*ALONE, DEVELOP]:
            _BUILT[name] = _POOL.submit(_install, root / name, name)
    return _BUILT


@pytest.fixture(scope="module")
def venvs() -> Iterator[dict[str, Future[Path]]]:
    """The venvs of :func:`start_installs`, deleted after this module's tests."""
    built = start_installs()
    yield built
    wait(built.values())
    for root in _ROOTS:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(
    ("name", "plugins", "rows"),
    [
        pytest.param(
            "ups-samplers",
            {"ups-samplers": "ups-samplers"},
            [["sampler", "tensor", "ups-samplers", "ups-samplers", "0.2.0", "enabled"]],
            id="ups-samplers",
        ),
        pytest.param(
            "ups-blocks",
            {"blocks": "ups-blocks"},
            [["sampler", "blocks", "blocks", "ups-blocks", "0.1.0", "enabled"]],
            id="ups-blocks",
        ),
        pytest.param(  # hooks only: no record, so `ups plugins` has no row of its own
            "ups-tensorboard",
            {"tensorboard": "ups-tensorboard"},
            [],
            id="ups-tensorboard",
        ),
        pytest.param(  # a config section: `ups plugins` lists it
            "ups-mlflow",
            {"mlflow": "ups-mlflow"},
            [["section", "mlflow", "mlflow", "ups-mlflow", "0.1.0", "enabled"]],
            id="ups-mlflow",
        ),
        pytest.param(
            "ups-wandb",
            {"wandb": "ups-wandb"},
            [["section", "wandb", "wandb", "ups-wandb", "0.1.0", "enabled"]],
            id="ups-wandb",
        ),
    ],
)
def test_installing_one_distribution_alone(
    name: str, plugins: dict[str, str], rows: list[list[str]], venvs: dict[str, Future[Path]]
) -> None:
    venv = venvs[name].result()
    python = venv / "bin" / "python"
    installed = run(python, "-m", "pip", "list", "--format=freeze", cwd=venv).lower()
    names = {line.split("==")[0] for line in installed.split()}
    assert "torch" in names
    assert names & UPS == {"ups-dist-core", *plugins.values()}
    loaded = {tuple(line.split()) for line in run(python, "-c", PLUGINS, cwd=venv).splitlines()}
    expected = {("ups-dist-core", "ups-dist-core"), *plugins.items()}
    assert loaded == {(name, distribution, "enabled") for name, distribution in expected}
    listing = run(venv / "bin" / "ups", "plugins", cwd=venv)
    listed = [line.split()[:6] for line in listing.splitlines()]  # the description left out
    for row in [CORE_ROW, *rows]:
        assert row in listed


def test_the_contributor_install_is_every_distribution_editable(
    venvs: dict[str, Future[Path]],
) -> None:
    """README "Developing": ``pip install -r requirements-dev.txt``, a list of ``-e FOLDER``
    requests, resolves (an editable ups-dist-core satisfies the others' requirement of it) and
    installs each distribution editable, imported from the tree."""
    venv = venvs[DEVELOP].result()
    python = venv / "bin" / "python"
    local = run(python, "-m", "pip", "list", "--local", "--editable", "--format=freeze", cwd=ROOT)
    assert {line.split("==")[0].lower() for line in local.split()} == UPS
    where = "import ups.samplers, ups_blocks; print(ups.samplers.__file__, ups_blocks.__file__)"
    for path in run(python, "-c", where, cwd=venv).split():
        assert Path(path).is_relative_to(ROOT)
    listing = run(venv / "bin" / "ups", "plugins", cwd=venv)
    listed = [line.split()[:6] for line in listing.splitlines()]
    assert ["sampler", "blocks", "blocks", "ups-blocks", "0.1.0", "enabled"] in listed
