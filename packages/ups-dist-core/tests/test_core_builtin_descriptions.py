"""The built-in plugins' descriptions say what they make."""

from __future__ import annotations

import re
from pathlib import Path

from ups.core import load_config, load_plugins, train
from ups.core.testing import tiny_project


def test_the_simple_backend_s_description_names_the_files_of_its_folder(tmp_path: Path) -> None:
    train(load_config(tiny_project(tmp_path)))
    saved = tmp_path / "runs" / "tiny" / "checkpoints"
    checkpoint = saved / (saved / "latest").read_text().strip()
    assert checkpoint.is_dir()

    description = load_plugins().records("checkpoint")["simple"].record.description

    assert "a folder per checkpoint" in description
    names = {re.sub(r"rank-\d+", "rank-<r>", file.name) for file in checkpoint.iterdir()}
    assert names == {"state.pt", "rank-<r>.pt", "COMMIT"}
    assert all(name in description for name in names), description
