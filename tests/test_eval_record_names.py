"""The names of an evaluation's metrics, as docs/config.md gives them: with a ``val_`` prefix
in the log's ``eval`` events, without it in ``metrics.jsonl``'s ``eval`` lines and in
``TrainResult.eval_metrics``; checked on a real run of two tasks."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ups.core import train

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("plus", "minus")


def named(keys: set[str]) -> set[str]:
    """``keys`` with each task's name written ``<task>``, as the docs write them."""
    return {re.sub(rf"/({'|'.join(TASKS)})$", "/<task>", key) for key in keys}


def documented() -> tuple[set[str], set[str]]:
    """The names config.md's evaluation paragraph gives the log's ``eval`` events, and those
    it gives ``metrics.jsonl``'s ``eval`` lines (and the hook, and ``TrainResult``)."""
    text = " ".join((ROOT / "docs" / "config.md").read_text(encoding="utf-8").split())
    start = text.index("It is logged as an `eval` event")
    logged, recorded = text[start : text.index(". ", start)].split(";")
    return set(re.findall(r"`(val_[^`]+)`", logged)), set(
        re.findall(r"\(`(.+?)`\)", recorded)[0].split("`, `")
    )


def test_an_evaluation_s_names_are_those_config_md_gives(tmp_path: Path) -> None:
    data = {"factory": "ups.core.testing:two_task_dataset", "tasks": list(TASKS)}
    config = {
        "run": {"name": "names", "output_dir": str(tmp_path), "log_every": 2},
        "model": {"factory": "torch.nn:Linear", "options": {"in_features": 4, "out_features": 1}},
        "data": data,
        "eval": {"factory": data["factory"], "options": {"n": 16}, "every_steps": 4},
        "training": {"batch_size": 8},
    }
    result = train(config, nproc=1)
    run = tmp_path / "names"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    recorded = {key for line in lines if line["kind"] == "eval" for key in line} - {"kind", "step"}
    events = [json.loads(line) for line in (run / "logs" / "rank0.jsonl").read_text().splitlines()]
    logged = {key for e in events if e["event"] == "eval" for key in e if key.startswith("val_")}

    for_the_log, for_the_file = documented()

    assert recorded == {"loss", "loss/plus", "loss/minus", "samples"}
    assert named(logged) == for_the_log == {f"val_{name}" for name in for_the_file}
    assert named(recorded) == for_the_file
    assert named(set(result.eval_metrics[-1])) == for_the_file
