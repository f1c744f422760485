"""Desync detection: the parameter checksum, and the check over a real 2-rank group."""

from __future__ import annotations

import torch
from torch import nn

from ups.core import RunContext
from ups.core.desync import DesyncError, check_in_sync, parameter_checksum
from ups.core.testing import run_ranks


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


def test_equal_parameters_give_equal_checksums_and_one_flipped_bit_another() -> None:
    a, b = model(), model()
    assert parameter_checksum(a) == parameter_checksum(b)
    with torch.no_grad():
        weight = b[0].weight.view(-1).view(torch.int32)
        weight[5] ^= 1  # the lowest bit of one float
    assert parameter_checksum(a) != parameter_checksum(b)


def test_buffers_are_left_out() -> None:
    a, b = model(), model()
    b[1].running_mean += 1  # DDP syncs buffers from rank 0 at the next forward
    assert parameter_checksum(a) == parameter_checksum(b)


def check(ctx: RunContext, diverge: str) -> str:
    """Rank 1 differs as ``diverge`` says (``none``, ``parameters``, ``config``); the check's
    message on this rank, or ``in sync``."""
    net = model()
    digest = "0123456789abcdef"
    if ctx.rank == 1 and diverge == "parameters":
        with torch.no_grad():
            net[2].bias += 1e-7
    if ctx.rank == 1 and diverge == "config":
        digest = "fedcba9876543210"
    try:
        check_in_sync(ctx, digest, 3, net)
    except DesyncError as error:
        return str(error)
    return "in sync"


def test_ranks_in_sync_pass_the_check() -> None:
    assert run_ranks(check, 2, "none") == ["in sync", "in sync"]


def test_a_diverged_rank_is_named_on_every_rank() -> None:
    expected = (
        "step 3: ranks out of sync with rank 0: rank 1 in its parameters (restart them from "
        "one checkpoint, with one config)"
    )
    assert run_ranks(check, 2, "parameters") == [expected, expected]
    assert run_ranks(check, 2, "config")[0].startswith(
        "step 3: ranks out of sync with rank 0: rank 1 in its config ("
    )
