"""The bundled example, trained as the README's first command does: ups train --nproc 2."""

from __future__ import annotations

from pathlib import Path

from ups.core.testing import events, run_ups

ROOT = Path(__file__).resolve().parents[1]


def test_the_example_trains_on_two_ranks_with_one_log(tmp_path: Path) -> None:
    result = run_ups(
        *("train", str(ROOT / "examples" / "pde_multitask.yaml"), "--nproc", "2"),
        *("-o", f"run.output_dir={tmp_path}"),
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    logged = events(result.stderr)
    assert [e for e in logged if e["level"] != "info"] == []  # no warning about our own demo
    folder = tmp_path / "pde-multitask"
    assert result.stdout.splitlines()[-1] == (
        f"ups: the run's files are in {folder}; plot them: ups report {folder}"
    )
    # rank 0 reports; the other rank stays quiet unless something is wrong
    assert {e.get("rank") for e in logged if e["level"] == "info"} == {0}
    start = next(e for e in logged if e["event"] == "training")
    assert (start["world_size"], start["backend"]) == (2, "gloo")
    steps = [e for e in logged if e["event"] == "step"]
    for task in ("advection", "diffusion", "burgers"):
        assert all(e[f"loss/{task}"] > 0 for e in steps)  # per-task losses, aggregated
    losses = [e["loss"] for e in steps]
    assert len(losses) == 12  # 5 epochs x 24 steps, reported every 10
    assert losses[-1] < losses[0] / 4
    done = [e for e in logged if e["event"] == "done"]
    assert len(done) == 1 and done[0]["steps"] == 120
    checkpoints = sorted(p.name for p in (tmp_path / "pde-multitask" / "checkpoints").iterdir())
    assert checkpoints == ["latest", "step-100", "step-120"]
