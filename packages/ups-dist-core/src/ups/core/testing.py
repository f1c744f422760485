"""Test helpers for ups and its plugins: run a function on real local process groups.

Like PyTorch's ``MultiProcessTestCase``: real processes, a real gloo process group on CPU,
no mocks. The function must be importable by the spawned processes (defined at module level).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue as queue_module
import socket
import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .context import distributed_session

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    """Run ``fn(ctx, *args)`` in ``world_size`` spawned processes; return each rank's result.

    Each process gets ``env(rank, world_size, port)`` as its launcher environment and joins a
    gloo process group through :func:`~ups.core.distributed_session` (``enabled=True``).

    :raises AssertionError: naming the rank, with its traceback, when a rank raises or hangs.
    """
    port = free_port()
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    procs = [
        spawn.Process(
            target=_child,
            args=(fn, rank, dict(env(rank, world_size, port)), args, queue, timeout_s),
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
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        with distributed_session(True, "gloo", timeout_s) as ctx:
            # Pickled here, so tensors travel as bytes, not as shared memory that dies with us.
            queue.put((rank, True, pickle.dumps(fn(ctx, *args))))
    except BaseException:  # reported to the parent with its traceback
        queue.put((rank, False, traceback.format_exc()))
