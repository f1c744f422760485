"""The run context: reading launchers' environments, and real gloo process groups from them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from structlog.testing import capture_logs

from ups.core import RunContext, UsageError, distributed_session
from ups.core.dist._context import first_host, launched, read_placement
from ups.core.testing import free_port, run_ranks, torchrun_env


def test_no_launcher_means_a_single_process() -> None:
    place = read_placement({})
    assert (place.rank, place.world_size, place.launcher) == (0, 1, "single")
    assert not launched({})


def test_torchrun_variables() -> None:
    env = torchrun_env(3, 4, 29500) | {
        "GROUP_RANK": "1",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    place = read_placement(env)
    assert (
        place.rank,
        place.local_rank,
        place.world_size,
        place.local_world_size,
        place.node_rank,
    ) == (3, 1, 4, 2, 1)
    assert (place.launcher, place.master_addr, place.master_port) == (
        "torchrun",
        "127.0.0.1",
        29500,
    )


def slurm_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": str(world_size),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_NNODES": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def test_slurm_variables_and_the_rendezvous_host() -> None:
    env = slurm_env(1, 2, 0) | {"SLURM_JOB_NODELIST": "gpu[07-09,11],cpu1", "SLURM_NNODES": "4"}
    del env["MASTER_PORT"]
    place = read_placement(env)
    assert (place.rank, place.world_size, place.launcher, place.master_addr) == (
        1,
        2,
        "slurm",
        "gpu07",
    )
    assert place.master_port == 15000 + 4242


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("node1", "node1"), ("node[3-5]", "node3"), ("a[10,12-14],b2", "a10"), ("x-1,y", "x-1")],
)
def test_first_host(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_torchrun_wins_over_slurm_for_srun_torchrun() -> None:
    env = slurm_env(0, 1, 1) | torchrun_env(5, 8, 2)
    assert read_placement(env).launcher == "torchrun"
    assert read_placement(env).rank == 5


def test_a_non_integer_rank_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="RANK='x' is not an integer"):
        read_placement({"RANK": "x", "WORLD_SIZE": "2"})


def describe_and_sum(ctx: RunContext) -> tuple[int, int, str | None, str, float]:
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    return ctx.rank, ctx.world_size, ctx.backend, ctx.launcher, float(value)


def test_two_ranks_from_torchrun_variables() -> None:
    results = run_ranks(describe_and_sum, 2)
    assert results == [(0, 2, "gloo", "torchrun", 3.0), (1, 2, "gloo", "torchrun", 3.0)]


def test_two_ranks_from_slurm_variables() -> None:
    results = run_ranks(describe_and_sum, 2, env=slurm_env)
    assert results == [(0, 2, "gloo", "slurm", 3.0), (1, 2, "gloo", "slurm", 3.0)]


def test_a_single_process_needs_no_process_group() -> None:
    with distributed_session("auto", env={}) as ctx:
        assert not ctx.distributed and ctx.world_size == 1 and ctx.is_main
        assert not dist.is_initialized()


def test_one_rank_with_distributed_true_forms_a_real_group() -> None:
    with distributed_session(True, "gloo", env=torchrun_env(0, 1, free_port())) as ctx:
        assert ctx.distributed and dist.is_initialized() and dist.get_world_size() == 1
    assert not dist.is_initialized()


def test_enabled_false_refuses_to_be_one_of_several_ranks() -> None:
    with (
        pytest.raises(
            UsageError, match="distributed.enabled is false but this process is rank 1 of 2"
        ),
        distributed_session(False, env=torchrun_env(1, 2, 1)),
    ):
        pytest.fail("ran as a single process although launched as rank 1 of 2")


UNREACHABLE = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}


def test_failed_init_is_an_error_when_asked_for() -> None:
    env = UNREACHABLE | {"MASTER_PORT": str(free_port())}
    with (
        pytest.raises(
            UsageError, match="distributed.enabled is true but rank 1 of 2 could not join"
        ),
        distributed_session(True, "gloo", timeout_s=1, env=env),
    ):
        pytest.fail("went on without the process group it was asked to join")


def test_failed_init_falls_back_to_one_process_with_a_warning_on_auto() -> None:
    env = UNREACHABLE | {"MASTER_PORT": str(free_port())}
    with capture_logs() as logs, distributed_session("auto", "gloo", timeout_s=1, env=env) as ctx:
        assert not ctx.distributed and ctx.world_size == 1
    assert logs[0]["event"] == "distributed init failed; running as a single process"
    assert logs[0]["rank"] == 1 and logs[0]["log_level"] == "warning"


def test_the_restart_count_is_read_from_torchrun_or_a_requeued_slurm_job() -> None:
    assert read_placement(torchrun_env(0, 2, 29500)).restart_count == 0
    restarted = torchrun_env(0, 2, 29500) | {"TORCHELASTIC_RESTART_COUNT": "2"}
    assert read_placement(restarted).restart_count == 2
    requeued = slurm_env(1, 2, 0) | {"SLURM_RESTART_COUNT": "1"}
    assert read_placement(requeued).restart_count == 1
