"""``ups report``: a run folder's metrics as a summary table and a figure.

The input is what rank 0 writes into the run folder (see :mod:`ups.core.engine._rundir`):
``metrics.jsonl``, one JSON object a line with ``kind`` (``train`` or ``eval``; ``phases``: each
rank's seconds per step in each phase, ``ranks`` a row a rank in the order ``phases`` names,
and the ``straggler`` rank and its ``straggler_phase`` if one was named) and ``step``,
and ``config.yaml``, whose ``run.name`` titles the report. Every other key is optional, so
files written by older engines (without ``samples_per_s``, say) report what they have.

A resumed run first drops the lines after its checkpoint (:func:`ups.core.engine._rundir.keep_until`),
so each step appears once; in a file an earlier ups wrote, a resumed step can appear twice:
the later line wins.
The table needs nothing more; the figure needs matplotlib (the ``report`` extra), imported
only when one is drawn.
"""

from __future__ import annotations

import collections
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ..config._errors import UsageError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "NoMatplotlibError",
    "Record",
    "plot",
    "read_metrics",
    "run_name",
    "summary",
    "write_report",
]

Record = dict[str, Any]
"""One line of ``metrics.jsonl``: ``kind`` (str), ``step`` (int) and numbers (``null`` read
as NaN). ``train``, ``eval``, ``best`` and ``phases`` lines are reported; other kinds are read
and ignored."""

_NUMERIC = ("loss", "samples_per_s", "oom_skipped")
"""Keys (besides ``loss/<task>``) that must hold a number or ``null`` when present."""
_ABOUT_THE_RUN = frozenset(
    [
        "samples",
        "lr",
        "grad_norm",
        "oom_skipped",
        "allreduce_bytes",
        "samples_per_s",
        "step_time_s",
        "tokens_per_s",
        "tflops",
        "mfu",
    ]
)
"""What the engine reports about the run rather than the model (docs/loop.md#metrics), with
the comm hook's ``comm_*``: no rows or panels of their own (throughput and the OOM-skipped
batches are summed up in rows of theirs). Every other key is the loss or a metric of the
step, reported per task or not."""


class NoMatplotlibError(UsageError):
    """:func:`plot`'s error when matplotlib cannot be imported."""


def read_metrics(run_dir: Path) -> list[Record]:
    """Read ``run_dir/metrics.jsonl``, one record a line in file order (blank lines skipped).

    :raises UsageError: naming the folder or file when ``run_dir`` is not a folder,
        ``metrics.jsonl`` is missing or holds no record, or (with its line number) when a line
        is not a JSON object with a string ``kind`` and a non-negative integer ``step``, or a
        loss or throughput that is neither a number nor ``null``.
    """
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: no such run folder")
    path = run_dir / "metrics.jsonl"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file; is {run_dir} a run folder?") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"{path}: cannot read: {error}") from None
    records = [
        _record(line, f"{path}:{number}")
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip()
    ]
    if not records:
        raise UsageError(f"{path}: no metrics in the file")
    return records


def _record(line: str, where: str) -> Record:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise UsageError(f"{where}: not JSON: {error.msg} (column {error.colno})") from None
    if not isinstance(record, dict):
        raise UsageError(f"{where}: not a JSON object")
    if not isinstance(record.get("kind"), str):
        raise UsageError(f"{where}: no 'kind' string")
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UsageError(f"{where}: 'step' is {step!r}, not a non-negative integer")
    for key, value in record.items():
        if (key in _NUMERIC or key.startswith("loss/")) and not _is_number_or_null(value):
            raise UsageError(f"{where}: {key!r} is {value!r}, not a number or null")
    return {k: math.nan if v is None else v for k, v in record.items()}


def _is_number_or_null(value: object) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def run_name(run_dir: Path) -> str:
    """The run's name from ``run_dir/config.yaml`` (``run.name``), else the folder's name."""
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return run_dir.name
    run = config.get("run") if isinstance(config, dict) else None
    name = run.get("name") if isinstance(run, dict) else None
    return name if isinstance(name, str) and name else run_dir.name


def summary(records: Sequence[Record], name: str) -> str:
    """A plain two-column table: the run's name, its last step, the final training loss and
    metrics of the step (each overall and per task, a metric reduced to one number too), the
    best and final evaluation loss (with their steps) and the final evaluation metrics,
    keep-best's best checkpoint (a ``best`` record: its step and value), the median
    throughput, the OOM-skipped batches, and each rank's time per step by phase with the
    straggler named (``phases`` lines). Rows whose metrics the records lack are left out.
    Needs no matplotlib.
    """
    train, evals = _by_step(records, "train"), _by_step(records, "eval")
    rows = [("run", name), ("steps", _steps(records, train, evals))]
    for family in _families(train):
        for key in _family_keys(train, family):
            step, value = _final(train, key)
            rows.append((f"train {key}", f"{_number(value)} (step {step})"))
    for family in _families(evals):
        for key in _family_keys(evals, family):
            step, value = _final(evals, key)
            final = f"final {_number(value)} (step {step})"
            if family != "loss":
                rows.append((f"eval {key}", final))
                continue
            series = _series(evals, key)
            best = min(((v, s) for s, v in series if not math.isnan(v)), default=None)
            best_text = f"{_number(best[0])} (step {best[1]})" if best else "n/a"
            rows.append((f"eval {key}", f"best {best_text}, {final}"))
    kept = _by_step(records, "best")
    if kept:  # keep-best's: each line a new best checkpoint, the last the best kept
        step, (monitor, value) = kept[-1]["step"], _values(kept[-1])[0]
        rows.append(("best checkpoint", f"step {step}, {monitor} {_number(value)}"))
    throughput = [v for _, v in _series(train, "samples_per_s") if not math.isnan(v)]
    if throughput:
        rows.append(("throughput", f"{statistics.median(throughput):,.1f} samples/s (median)"))
    skipped = _oom_skipped(records)
    if skipped is not None:
        rows.append(("oom-skipped", f"{skipped} batches"))
    rows += _phase_rows(_by_step(records, "phases"))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in rows)


def _phase_rows(phases: Sequence[Record]) -> list[tuple[str, str]]:
    """The step-time panel: each rank's milliseconds per step in each phase (the mean over
    the reports), and the straggler the reports named, with its phase and how often."""
    if not phases:
        return []
    names, count = phases[-1]["phases"], len(phases)
    ranks = len(phases[-1]["ranks"])
    rows = [("step time", f"ms per step by rank, mean over {_count(count, 'report')}")]
    for rank in range(ranks):
        means = [
            statistics.fmean(p["ranks"][rank][i] for p in phases if len(p["ranks"]) == ranks)
            for i in range(len(names))
        ]
        text = ", ".join(f"{name} {1000 * m:.3g}" for name, m in zip(names, means, strict=True))
        rows.append((f"  rank {rank}", text))
    named = [(p["straggler"], p["straggler_phase"]) for p in phases if "straggler" in p]
    if not named:
        rows.append(("straggler", "none"))
    for (rank, phase), times in collections.Counter(named).most_common():
        rows.append(("straggler", f"rank {rank} ({phase}) in {times} of {count} reports"))
    return rows


def _values(record: Record) -> list[tuple[str, float]]:
    """A record's values: every key but ``kind`` and ``step``."""
    return [(key, value) for key, value in record.items() if key not in ("kind", "step")]


def _steps(records: Sequence[Record], train: list[Record], evals: list[Record]) -> str:
    last = max((r["step"] for r in records), default=0)
    return f"{last} ({_count(len(train), 'training report')}, {_count(len(evals), 'evaluation')})"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _number(value: float) -> str:
    return f"{value:.4g}"


def _by_step(records: Sequence[Record], kind: str) -> list[Record]:
    """The records of ``kind``, one per step (the last written wins), in step order."""
    latest = {r["step"]: r for r in records if r["kind"] == kind}
    return [latest[step] for step in sorted(latest)]


def _families(records: Sequence[Record]) -> list[str]:
    """``loss`` (when present), then each metric of the step (``name``, and ``name/<task>``
    beside it for a per-sample metric of a multi-task run) in the order they first appear;
    not ``kind``, ``step`` or what :data:`_ABOUT_THE_RUN` holds."""
    bases = dict.fromkeys(k.split("/", 1)[0] for r in records for k in r)
    found = [
        b
        for b in bases
        if b not in ("kind", "step", "loss")
        and b not in _ABOUT_THE_RUN
        and not b.startswith("comm_")
    ]
    return ["loss", *found] if "loss" in bases else found


def _family_keys(records: Sequence[Record], base: str) -> list[str]:
    """``base`` (when present), then each ``base/<task>`` in the order tasks first appear."""
    keys = dict.fromkeys(k for r in records for k in r if k == base or k.startswith(f"{base}/"))
    return sorted(keys, key=lambda k: k != base)


def _series(records: Sequence[Record], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` for each record holding ``key`` (``None`` as NaN)."""
    return [(r["step"], math.nan if r[key] is None else float(r[key])) for r in records if key in r]


def _final(records: Sequence[Record], key: str) -> tuple[int, float]:
    return _series(records, key)[-1]


def _oom_skipped(records: Sequence[Record]) -> int | None:
    """The batches skipped for OOM over the file, or None when no line counts them.

    ``oom_skipped`` is the process's running count, so a drop means a restarted (resumed)
    process whose count started again from zero."""
    counts = [r["oom_skipped"] for r in records if r["kind"] == "train" and "oom_skipped" in r]
    counts = [int(c) for c in counts if c is not None and not math.isnan(c)]
    if not counts:
        return None
    total, previous = 0, 0
    for count in counts:
        total += count - previous if count >= previous else count
        previous = count
    return total


def plot(records: Sequence[Record], path: Path, title: str) -> Figure:
    """Draw the report's figure into ``path`` (its format from the suffix; PNG without one),
    with matplotlib's Agg backend, and return it. One panel each, sharing the step axis:
    ``Training loss`` (overall and per task), ``Training <metric>`` for each metric
    the step reports (each overall and per task), the same for evaluations (when there are
    any), ``Throughput`` (when the records have ``samples_per_s``) and ``Step time outside
    communication`` (each rank's, with ``phases`` lines). A loss or metric panel's
    y axis is logarithmic when every value on it is positive.

    :raises NoMatplotlibError: when matplotlib cannot be imported.
    :raises UsageError: when ``path``'s folder does not exist or its suffix names a format
        matplotlib cannot write.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise NoMatplotlibError(
            f"{path}: drawing the figure needs matplotlib: pip install 'ups-dist-core[report]'"
        ) from None
    if not path.parent.is_dir():
        raise UsageError(f"{path}: folder {path.parent} does not exist")
    train, evals = _by_step(records, "train"), _by_step(records, "eval")
    panels: list[tuple[str, list[Record], list[str], str]] = []
    for kind, rows in (("Training", train), ("Evaluation", evals)):
        for family in _families(rows):
            panels.append((f"{kind} {family}", rows, _family_keys(rows, family), family))
    if any(not math.isnan(v) for _, v in _series(train, "samples_per_s")):
        panels.append(("Throughput", train, ["samples_per_s"], "samples/s"))
    phases = _by_step(records, "phases")
    if phases:
        work = [_work_ms(p) for p in phases]
        keys = sorted({key for row in work for key in row if key != "step"})
        panels.append(("Step time outside communication", work, keys, "ms"))

    figure = Figure(figsize=(8, 1 + 3 * max(len(panels), 1)), layout="constrained")
    canvas = FigureCanvasAgg(figure)
    suffix = path.suffix.lstrip(".").lower()
    if suffix and suffix not in canvas.get_supported_filetypes():
        formats = ", ".join(sorted(canvas.get_supported_filetypes()))
        raise UsageError(f"{path}: matplotlib cannot write .{suffix} files; it writes {formats}")
    figure.suptitle(f"ups run: {title}")
    axes = figure.subplots(max(len(panels), 1), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, rows, keys, unit) in zip(axes, panels, strict=False):
        _panel(ax, name, rows, keys, unit)
    if not panels:
        axes[0].text(0.5, 0.5, "no losses or throughput recorded", ha="center", va="center")
    axes[-1].set_xlabel("step")
    figure.savefig(path, format=suffix or "png", dpi=100)
    return figure


def _work_ms(record: Record) -> Record:
    """A ``phases`` line as ``{step, "rank <r>": ms}``: each rank's milliseconds per step
    outside communication (data, forward, optimizer: what names a straggler)."""
    names = record["phases"]
    work = [names.index(name) for name in ("data", "forward", "optimizer") if name in names]
    ms = {f"rank {r}": 1000 * sum(row[i] for i in work) for r, row in enumerate(record["ranks"])}
    return {"step": record["step"], **ms}


def _panel(ax: Axes, name: str, records: Sequence[Record], keys: Sequence[str], unit: str) -> None:
    values: list[float] = []
    for key in keys:
        series = _series(records, key)
        steps, ys = [s for s, _ in series], [v for _, v in series]
        ax.plot(steps, ys, marker="o" if len(series) < 20 else None, markersize=3, label=key)
        values += [v for v in ys if math.isfinite(v)]
    ax.set_title(name)
    ax.set_ylabel(unit)
    ax.grid(True, alpha=0.3)
    if unit != "samples/s" and values and min(values) > 0:
        ax.set_yscale("log")
    if len(keys) > 1:
        ax.legend()


def write_report(
    run_dir: Path, output: Path | None = None, show: Callable[[str], object] | None = None
) -> tuple[Path, str]:
    """What ``ups report RUN_DIR`` makes of a run folder: its summary table, handed to
    ``show`` (when given) before anything is drawn, and its figure, drawn into ``output``
    (default ``RUN_DIR/report.png``); return both.

    :raises UsageError: as :func:`read_metrics` and :func:`plot` do (after ``show``: the table
        is shown whether or not the figure can be drawn).
    """
    records = read_metrics(run_dir)
    name = run_name(run_dir)
    table = summary(records, name)
    if show is not None:
        show(table)
    output = output or run_dir / "report.png"
    plot(records, output, name)
    return output, table
