"""Arguments of the Python API: one error naming the argument, what is allowed and the value
(:mod:`ups.core.config._arguments`; every public constructor is fed wrong values in
tests/test_api_arguments.py); and ranks that torchrun restarts under ``--master-port`` meeting
again (:func:`ups.core.distributed_session`)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ups.core import (
    ConfigError,
    Preemption,
    RunContext,
    UsageError,
    did_you_mean,
    distributed_session,
)
from ups.core.config._arguments import ArgumentTypeError, ArgumentValueError, choice, integer, shown
from ups.core.testing import free_port, torchrun_env


def test_integer_in_a_range_says_both_ends() -> None:
    with pytest.raises(ValueError, match=r"^rank: must be an int from 0 to 1, not 2$"):
        integer("rank", 2, low=0, high=1)


def test_choice_compares_types_and_offers_the_closest() -> None:
    with pytest.raises(ArgumentTypeError, match=r"must be one of True, False, 'auto', not 1$"):
        choice("enabled", 1, (True, False, "auto"))
    with pytest.raises(ValueError, match=r"not 'glooo'; did you mean 'gloo'\?$"):
        choice("backend", "glooo", ("auto", "gloo", "nccl"))


def test_argument_errors_are_python_errors_and_usage_errors() -> None:
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, ConfigError)
    assert issubclass(ArgumentValueError, ValueError) and issubclass(ArgumentValueError, UsageError)


def test_did_you_mean_ignores_case() -> None:
    assert did_you_mean("PowerSGD", ["powersgd", "topk"]) == "; did you mean 'powersgd'?"
    assert did_you_mean("zzz", ["powersgd"]) == ""


def test_a_value_is_shown_short() -> None:
    assert shown("x" * 100) == repr("x" * 100)[:37] + "..."
    assert shown([1, 2]) == "a list" and shown(object()) == "an object"
    assert shown(signal.SIGKILL) == "Signals.SIGKILL"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"enabled": "yes"}, ValueError, "enabled: must be one of True, False, 'auto', not 'yes'"),
        (
            {"backend": "glooo"},
            ValueError,
            "backend: must be one of 'auto', 'gloo', 'nccl', not 'glooo'; did you mean 'gloo'?",
        ),
        ({"timeout_s": "x"}, TypeError, "timeout_s: must be a finite number > 0, not 'x'"),
        ({"timeout_s": -5}, ValueError, "timeout_s: must be a finite number > 0, not -5"),
        ({"timeout_s": math.inf}, ValueError, "timeout_s: must be a finite number > 0, not inf"),
    ],
)
@pytest.mark.parametrize("launched", [False, True])
def test_distributed_session_names_a_bad_argument_before_anything(
    kwargs: dict[str, object], error: type[Exception], message: str, launched: bool
) -> None:
    env = torchrun_env(0, 2, free_port()) if launched else {}  # no peer: checked before joining
    with pytest.raises(error) as raised, distributed_session(env=env, **kwargs):  # type: ignore[arg-type]
        pass
    assert isinstance(raised.value, ConfigError) and str(raised.value) == message


@pytest.mark.parametrize(
    ("signals", "error", "message"),
    [
        ([signal.SIGKILL], ValueError, "must be signals a handler can catch, such as "),
        ([signal.SIGTERM, signal.SIGSTOP], ValueError, "must be signals a handler can catch"),
        (signal.SIGTERM, TypeError, "must be an iterable of signals a handler can catch"),
        (["SIGTERM"], TypeError, "must be signals a handler can catch, such as signal.SIGTERM"),
    ],
)
def test_preemption_refuses_signals_it_cannot_catch(
    signals: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=rf"^signals: {message}") as raised:
        Preemption(RunContext(), signals)  # type: ignore[arg-type]
    assert isinstance(raised.value, ConfigError)


# -- restarts under a static rendezvous ------------------------------------------------------

RESTARTS = 2
"""Each restart meets the dead attempt's keys: a late rank's peers each connect to its old
address, or wait for it to connect to theirs (as gloo orders the pair), so each restart of
three ranks failed about 3 times in 4 before the fix."""

WORKER = textwrap.dedent(
    f"""
    import os, time
    import torch, torch.distributed as dist
    from ups.core import distributed_session

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if attempt > 0 and rank == size - 1:
        time.sleep(3)  # the others read this rank's keys first: the dead attempt's, if any
    with distributed_session(enabled=True, backend="gloo", timeout_s=20) as ctx:
        total = torch.ones(1)
        dist.all_reduce(total)
        print(f"attempt {{attempt}} rank {{ctx.rank}} total {{total.item():g}}", flush=True)
        if attempt < {RESTARTS}:
            if rank == 1:
                os._exit(3)  # the agent stops the other ranks too, and restarts them all
            time.sleep(60)
    """
)


def test_ranks_restarted_under_master_port_join_again(tmp_path: Path) -> None:
    """torchrun's static rendezvous (``--master-port``) keeps its agent's store across
    restarts: the restarted ranks join afresh, not at the dead ranks' addresses."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3"),
        *("--max-restarts", str(RESTARTS), "--master-port", str(free_port())),
        *("--monitor-interval", "0.1", str(script)),
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=env, check=False, cwd=tmp_path
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    for rank in range(3):
        assert f"attempt {RESTARTS} rank {rank} total 3" in said, said[-3000:]
