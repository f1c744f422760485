"""One oldest Python, declared alike: by every distribution's ``requires-python``, by mypy's
``python_version`` (the version the sources are type-checked for, the one CI provisions) and by
the README's and the quickstart's first lines. The code needs 3.11 (``logs.py`` calls
``logging.getLevelNamesMapping``, new in 3.11), so a distribution declaring 3.10 would install
where ``ups`` cannot start."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECTS = sorted(
    [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("plugins/*/pyproject.toml")]
)


def oldest_python() -> str:
    """The version mypy checks the sources for, ``3.11``, from the root ``pyproject.toml``."""
    root = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    version: str = root["tool"]["mypy"]["python_version"]
    return version


def test_every_distribution_requires_the_python_the_sources_are_checked_for() -> None:
    assert len(PYPROJECTS) == 11  # 6 distributions of packages/, 5 plugins of plugins/
    declared = {
        str(path.relative_to(ROOT)): tomllib.loads(path.read_text(encoding="utf-8"))["project"][
            "requires-python"
        ]
        for path in PYPROJECTS
    }
    expected = f">={oldest_python()}"
    assert {path: expected for path in declared} == declared


def test_the_readme_and_the_quickstart_name_the_oldest_python() -> None:
    version = re.escape(oldest_python())
    for page in ("README.md", "docs/quickstart.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        said = re.findall(r"Python (3\.\d+)(?:\.\d+)? or later", text)
        assert said, f"{page} does not say which Python it needs"
        assert re.fullmatch(version, said[0]), f"{page} says Python {said[0]} or later"
