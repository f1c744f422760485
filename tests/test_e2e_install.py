"""A user installs one distribution into a fresh venv, from its folder, with ups-dist-core's
folder beside it (every distribution asks for ups-dist-core by name; it is not published):
torch comes along, nothing of the other ups distributions does. A contributor installs every
distribution and plugin editable into one venv with the README's one command."""

from __future__ import annotations

import subprocess
import sys
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


def run(*args: str | Path, cwd: Path) -> str:
    result = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=900, cwd=cwd
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


@pytest.mark.parametrize(
    ("folders", "plugins", "rows"),
    [
        pytest.param(
            ["packages/ups-dist-core", "packages/ups-samplers"],
            {"ups-samplers": "ups-samplers"},
            [["sampler", "tensor", "ups-samplers", "ups-samplers", "0.1.0", "enabled"]],
            id="ups-samplers",
        ),
        pytest.param(
            ["packages/ups-dist-core", "plugins/ups-blocks"],
            {"blocks": "ups-blocks"},
            [["sampler", "blocks", "blocks", "ups-blocks", "0.1.0", "enabled"]],
            id="ups-blocks",
        ),
        pytest.param(  # hooks only: no record, so `ups plugins` has no row of its own
            ["packages/ups-dist-core", "plugins/ups-tensorboard"],
            {"tensorboard": "ups-tensorboard"},
            [],
            id="ups-tensorboard",
        ),
        pytest.param(  # a config section: `ups plugins` lists it
            ["packages/ups-dist-core", "plugins/ups-mlflow"],
            {"mlflow": "ups-mlflow"},
            [["section", "mlflow", "mlflow", "ups-mlflow", "0.1.0", "enabled"]],
            id="ups-mlflow",
        ),
        pytest.param(
            ["packages/ups-dist-core", "plugins/ups-wandb"],
            {"wandb": "ups-wandb"},
            [["section", "wandb", "wandb", "ups-wandb", "0.1.0", "enabled"]],
            id="ups-wandb",
        ),
    ],
)
def test_installing_one_distribution_alone(
    folders: list[str], plugins: dict[str, str], rows: list[list[str]], tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    # torch pinned to the build on this machine's disk (the distributions ask for any torch >=
    # 2.2), the rest by the constraints nox installs with, so that pip resolves at once
    constraints = ROOT / "constraints-ci.txt"
    folder_paths = [ROOT / folder for folder in folders]
    pip: list[str | Path] = [
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "-c",
        constraints,
        "torch==2.13.0",
    ]
    run(*pip, *folder_paths, cwd=tmp_path)
    installed = run(python, "-m", "pip", "list", "--format=freeze", cwd=tmp_path).lower()
    names = {line.split("==")[0] for line in installed.split()}
    assert "torch" in names
    assert names & UPS == {"ups-dist-core", *plugins.values()}
    loaded = {tuple(line.split()) for line in run(python, "-c", PLUGINS, cwd=tmp_path).splitlines()}
    expected = {("ups-dist-core", "ups-dist-core"), *plugins.items()}
    assert loaded == {(name, distribution, "enabled") for name, distribution in expected}
    listing = run(venv / "bin" / "ups", "plugins", cwd=tmp_path)
    listed = [line.split() for line in listing.splitlines()]
    for row in [CORE_ROW, *rows]:
        assert row in listed


def test_the_contributor_install_is_every_distribution_editable(tmp_path: Path) -> None:
    """README "Developing": ``pip install -r requirements-dev.txt``, a list of ``-e FOLDER``
    requests, resolves (an editable ups-dist-core satisfies the others' requirement of it) and
    installs each distribution editable, imported from the tree. The venv sees the test
    environment's packages (``--system-site-packages``) so that torch and the like are not
    installed again; every ups distribution is installed into it all the same."""
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--system-site-packages", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "-r", "requirements-dev.txt", cwd=ROOT)
    local = run(python, "-m", "pip", "list", "--local", "--editable", "--format=freeze", cwd=ROOT)
    assert {line.split("==")[0].lower() for line in local.split()} == UPS
    where = "import ups.samplers, ups_blocks; print(ups.samplers.__file__, ups_blocks.__file__)"
    for path in run(python, "-c", where, cwd=tmp_path).split():
        assert Path(path).is_relative_to(ROOT)
    listed = [
        line.split() for line in run(venv / "bin" / "ups", "plugins", cwd=tmp_path).splitlines()
    ]
    assert ["sampler", "blocks", "blocks", "ups-blocks", "0.1.0", "enabled"] in listed
