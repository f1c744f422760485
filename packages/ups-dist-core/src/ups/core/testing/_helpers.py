"""Test helpers for ups and its plugins: run a function on real local process groups.

Like PyTorch's ``MultiProcessTestCase``: real processes, a real gloo process group on CPU,
no mocks. The function must be importable by the new processes (defined at module level).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import pickle
import queue as queue_module
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import yaml
from torch.utils.data import TensorDataset

from ..checkpoint._commit import STATE_FILE, rank_file
from ..dist._context import distributed_session
from ..launch._forkserver import restore_environment, start_method
from ..launch._processes import free_port as free_port

if TYPE_CHECKING:
    import pytest

T = TypeVar("T")

TINY_MODULE = '''"""A tiny regression problem for tests: predict sum(x) from 4 inputs."""
import os
import pathlib
import signal

import torch
from torch import nn
from torch.utils.data import TensorDataset


def build_model(width=8, pid_dir=None, ignore_sigterm=False):
    if pid_dir:  # lets a test find every rank's process
        pathlib.Path(pid_dir, str(os.getpid())).touch()
    if ignore_sigterm:  # a rank that only SIGKILL stops
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))


def build_dataset(n=64):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def not_a_model():
    return 42
'''


def install_plugin(
    site: Path,
    name: str,
    module: str,
    source: str,
    version: str = "0.1",
    entry_point: str | None = None,
) -> None:
    """Install, into the folder ``site``, what pip would leave for a plugin distribution
    ``name``: the module ``module`` with ``source``, and a dist-info folder whose
    ``entry_points.txt`` lists it under the ``ups`` group as ``entry_point`` (default
    ``name``). Put ``site`` on ``sys.path`` (or ``PYTHONPATH``) and
    :func:`~ups.core.load_plugins` finds it."""
    (site / f"{module}.py").write_text(source)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[ups]\n{entry_point or name} = {module}\n")
    (info / "RECORD").write_text("")


KILLER_MODULE = '''"""A plugin whose process kills itself (SIGKILL) once the checkpoint of step
KILL_AT_STEP (an environment variable) is saved."""
import os
import signal

from ups.core import hookimpl


@hookimpl
def ups_checkpoint_saved(step):
    if step == int(os.environ.get("KILL_AT_STEP", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
'''
"""A plugin's source for :func:`install_plugin`: its run dies as a machine loss would kill it,
right after a checkpoint, to test what a resumed run continues."""


def tracker_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The run folder's ``metrics.jsonl`` as an experiment tracker should hold it: each metric
    as ``KIND/NAME`` (``train/loss``, ``eval/loss/TASK``) with its ``(step, value)`` pairs by
    step; at a step reported twice (a resumed run) the later line wins; ``null`` left out."""
    found: dict[str, dict[int, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        kind, step = record.pop("kind"), record.pop("step")
        for name, value in record.items():
            if value is not None:
                found.setdefault(f"{kind}/{name}", {})[step] = value
    return {key: sorted(steps.items()) for key, steps in found.items()}


@contextlib.contextmanager
def counting_all_reduces() -> Iterator[list[int]]:
    """While open, count this process's calls of ``torch.distributed.all_reduce`` (each still
    runs); yields a one-item list holding the count so far."""
    import torch.distributed as dist

    count = [0]
    all_reduce = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield count
    finally:
        dist.all_reduce = all_reduce


def two_task_dataset(n: int = 64) -> TensorDataset:
    """A ``data.factory`` of two tasks, alternating: the target is the sum of the 4 inputs, or
    its negation; items are ``(inputs, target, task_id)``."""
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    task = torch.arange(n) % 2
    return TensorDataset(x, x.sum(dim=1, keepdim=True) * (1 - 2 * task[:, None]), task)


def tiny_project(folder: Path, **sections: Any) -> Path:
    """Write ``tiny.py`` (:data:`TINY_MODULE`) and a config ``run.yaml`` training it into
    ``folder``; return the config's path.

    The config trains one epoch of 64 samples in batches of 8, reporting every 2 steps, into
    ``folder/runs/tiny``. Each keyword updates that section key by key (a list, such as
    ``schedule``, replaces it):
    ``tiny_project(tmp_path, training={"epochs": 3}, sampler={"name": "tensor"})``.
    """
    config: dict[str, Any] = {
        "run": {"name": "tiny", "output_dir": str(folder / "runs"), "log_every": 2},
        "model": {"factory": "tiny.py:build_model"},
        "data": {"factory": "tiny.py:build_dataset", "options": {"n": 64}},
        "training": {"epochs": 1, "batch_size": 8, "lr": 0.05},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values} if isinstance(values, Mapping) else values
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny.py").write_text(TINY_MODULE)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_ups(
    *args: str,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run the ``ups`` command (``python -m ups.core ARGS``) as users do, logging JSON, in
    ``cwd``, with ``env``'s variables added to this process's environment (``UPS_FAULTS``,
    ``PYTHONPATH``); return its exit status, stdout and stderr (never raising for the status).

    :raises subprocess.TimeoutExpired: when it runs longer than ``timeout`` seconds.
    """
    return subprocess.run(
        [sys.executable, "-m", "ups.core", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ | {"UPS_LOG_FORMAT": "json"} | dict(env or {}),
        cwd=cwd,
        check=False,
    )


def events(log: Path | str, name: str | None = None) -> list[dict[str, Any]]:
    """The JSON log events of ``log``, in order: of a log file when a :class:`~pathlib.Path`
    (a rank's ``logs/rank<N>.jsonl``, every attempt's; each line must be one), else of the text
    itself (``stderr`` from :func:`run_ups`, what a console got), whose lines that are not JSON
    objects (the launcher's own words) are left out. With ``name``, only the events so named.
    """
    if isinstance(log, Path):
        found = [json.loads(line) for line in log.read_text().splitlines()]
    else:
        found = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [e for e in found if name is None or e.get("event") == name]


def wait_for(
    condition: Callable[[], object],
    timeout: float,
    what: str,
    *,
    process: subprocess.Popen[Any] | None = None,
    details: Callable[[], str] | None = None,
) -> None:
    """Return once ``condition()`` is true, checking every 50 ms.

    :raises AssertionError: ``timed out after TIMEOUT s while waiting for WHAT``, or, once
        ``process`` (the one expected to bring the condition about) has exited, ``the
        process PID exited with status N while waiting for WHAT``; then ``details()`` (what
        the process logged, say) on the lines below.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            problem = f"the process {process.pid} exited with status {process.returncode}"
        elif time.monotonic() > deadline:
            problem = f"timed out after {timeout:g} s"
        else:
            time.sleep(0.05)
            continue
        more = f"\n{details()}" if details is not None else ""
        raise AssertionError(f"{problem} while waiting for {what}{more}")


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for ``rank`` of a one-machine job."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def run_ranks(
    fn: Callable[..., T],
    world_size: int = 2,
    *args: Any,
    env: Callable[[int, int, int], Mapping[str, str]] = torchrun_env,
    timeout_s: float = 60.0,
) -> list[T]:
    """Run ``fn(ctx, *args)`` in ``world_size`` new processes (forked from ups's forkserver,
    see :mod:`ups.core.launch._forkserver`, or spawned); return each rank's result.

    Each process gets ``env(rank, world_size, port)`` as its launcher environment and joins a
    gloo process group through :func:`~ups.core.distributed_session` (``enabled=True``).

    :raises AssertionError: naming the rank, with its traceback, when a rank raises or hangs.
    """
    port = free_port()
    context: Any = multiprocessing.get_context(start_method())  # typeshed: no Process here
    queue = context.Queue()
    launcher = dict(os.environ)
    procs = [
        context.Process(
            target=_child,
            args=(fn, rank, launcher | dict(env(rank, world_size, port)), args, queue, timeout_s),
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for _ in procs:
            rank, ok, value = queue.get(timeout=timeout_s + 30)
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors[rank] = value
    except queue_module.Empty:
        missing = sorted(set(range(world_size)) - results.keys() - errors.keys())
        raise AssertionError(f"ranks {missing} did not finish within {timeout_s + 30}s") from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
    return [results[rank] for rank in range(world_size)]


def _child(
    fn: Callable[..., Any],
    rank: int,
    env: dict[str, str],
    args: tuple[Any, ...],
    queue: Any,
    timeout_s: float,
) -> None:
    restore_environment(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        with distributed_session(True, "gloo", timeout_s) as ctx:
            # Pickled here, so tensors travel as bytes, not as shared memory that dies with us.
            queue.put((rank, True, pickle.dumps(fn(ctx, *args))))
    except BaseException:  # reported to the parent with its traceback
        queue.put((rank, False, traceback.format_exc()))


def read_checkpoint(location: str | os.PathLike[str]) -> dict[str, Any]:
    """A committed checkpoint folder's files, read as they are (``weights_only``, not verified):
    ``{"state": <state.pt>, "ranks": [<rank-0.pt>, <rank-1.pt>, ...]}``."""
    folder = Path(location)
    ranks: list[Any] = []
    while (path := folder / rank_file(len(ranks))).is_file():
        ranks.append(torch.load(path, weights_only=True))
    return {"state": torch.load(folder / STATE_FILE, weights_only=True), "ranks": ranks}


def assert_params_close(
    found: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], atol: float = 1e-6
) -> None:
    """Assert that two models' parameters (name to tensor, as a checkpoint's ``model``) have
    the same names and differ by at most ``atol`` each, absolutely: the equivalence the
    engine promises (N ranks as one process, k micro-batches as one batch) in fp32. The
    message names the first parameter that differs."""
    assert found.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(found[name], expected[name], rtol=0, atol=atol, msg=name)


def assert_bitwise_equal(found: Any, expected: Any, where: str = "state") -> None:
    """Assert that two states are equal to the bit: the same container types and keys, and
    tensors of the same dtype, shape and bytes (so NaN equals NaN, and -0.0 differs from 0.0).
    The message names the path of the first difference (``state['model']['0.weight']``)."""
    assert type(found) is type(expected), f"{where}: {type(found)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert (found.dtype, found.shape) == (expected.dtype, expected.shape), where
        as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (found, expected)]
        assert torch.equal(*as_bytes), f"{where}: the bytes differ"
    elif isinstance(expected, dict):
        assert list(found) == list(expected), f"{where}: keys {list(found)} != {list(expected)}"
        for key in expected:
            assert_bitwise_equal(found[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert len(found) == len(expected), f"{where}: length {len(found)} != {len(expected)}"
        for i, (x, y) in enumerate(zip(found, expected, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert found == expected, f"{where}: {found!r} != {expected!r}"


@contextlib.contextmanager
def two_machines(tag: str) -> Iterator[tuple[str, str]]:
    """Two "machines" on this host: network namespaces ``ups-<tag>-a`` and ``ups-<tag>-b``
    joined by a veth pair, 10.77.0.1 on device ``v<tag>a`` and 10.77.0.2 on ``v<tag>b``;
    every process in them killed and both deleted again, whatever happened. Needs root and
    iproute2; ``tag`` keeps concurrent tests apart (a few characters: device names are short)."""
    names = (f"ups-{tag}-a", f"ups-{tag}-b")
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True)
        subprocess.run(
            ["ip", "link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b"],
            check=True,
        )
        for i, (name, end) in enumerate(zip(names, "ab", strict=True), start=1):
            device = f"v{tag}{end}"
            for command in (
                ["ip", "link", "set", device, "netns", name],
                ["ip", "-n", name, "addr", "add", f"10.77.0.{i}/24", "dev", device],
                ["ip", "-n", name, "link", "set", device, "up"],
                ["ip", "-n", name, "link", "set", "lo", "up"],
            ):
                subprocess.run(command, check=True)
        yield names
    finally:
        for name in names:
            kill_all_in(name)
            subprocess.run(["ip", "netns", "delete", name], check=False)


def kill_all_in(namespace: str) -> None:
    """SIGKILL every process of ``namespace`` (a machine lost)."""
    found = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for pid in found.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


WITHOUT = "UPS_TEST_WITHOUT"
"""The packages (comma-separated) that :func:`without` makes processes lack."""
SITECUSTOMIZE = f'''"""Imports of the packages named in ${WITHOUT} fail, as if not installed."""
import os
import sys
from importlib.abc import MetaPathFinder

_ABSENT = frozenset(filter(None, os.environ.get("{WITHOUT}", "").split(",")))


class _Absent(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Absent())
'''
"""A ``sitecustomize`` module: on ``PYTHONPATH``, the interpreter runs it at start-up, and a
finder first on ``sys.meta_path`` answers an import of the packages :data:`WITHOUT` names (and
of their modules) as Python answers one of a package that is not there."""


def without(monkeypatch: pytest.MonkeyPatch, folder: Path, *packages: str) -> None:
    """Have the processes a test starts from now on (:func:`run_ups`, ``subprocess``) run as
    where ``packages`` are not installed (everything else from the same environment), through
    a ``sitecustomize`` in ``folder``; checks that they do."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    paths = [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.setenv(WITHOUT, ",".join(packages))
    for package in packages:
        tried = subprocess.run(
            [sys.executable, "-c", f"import {package}"], capture_output=True, text=True, check=False
        )
        assert f"ModuleNotFoundError: No module named '{package}'" in tried.stderr, tried
