"""Real process groups for tests, like PyTorch's ``MultiProcessTestCase``: a function run on
local ranks of a gloo group on CPU, and two machines as network namespaces. No mocks: the
function must be importable by the new processes (defined at module level)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue as queue_module
import signal
import subprocess
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ..dist._context import distributed_session
from ..launch._forkserver import restore_environment, start_method
from ..launch._processes import free_port as free_port

if TYPE_CHECKING:
    pass

T = TypeVar("T")


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
