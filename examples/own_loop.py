"""A hand-written DDP loop with the parts of ups: the multi-task PDE problem of pde_multitask.py.

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # restarted ranks meet afresh
    torchrun --nproc-per-node 2 --max-restarts 1 examples/own_loop.py --out runs/own-loop

Multi-task sampler, PowerSGD, a checkpoint in the background every ``--every`` steps, resumed
from the newest one when (re)started, a STOP file that rank 0 looks for and every rank obeys,
and SIGTERM/SIGUSR1 (preemption) turned into a save and a stop at one step on every rank.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import structlog
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ups.ckpt import checkpointer
from ups.comm_hooks import register_hook
from ups.core import LossWindow, Preemption, Watchdog, decide, distributed_session
from ups.samplers import MultiTaskDistributedSampler

sys.path.insert(0, str(Path(__file__).parent))
from pde_multitask import TASKS, build_dataset, build_model

log = structlog.get_logger()
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", type=Path, default=Path("runs/own-loop"))
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
parser.add_argument("--samples", type=int, default=256, help="samples per task")
args = parser.parse_args()


def batches(
    loader: DataLoader[tuple[torch.Tensor, ...]], sampler: MultiTaskDistributedSampler
) -> Iterator[tuple[torch.Tensor, ...]]:
    """The loader's batches, epoch after epoch, from where the sampler's state says."""
    epoch = sampler.epoch
    while True:
        sampler.set_epoch(epoch)  # the loaded epoch goes on where it stopped; others start anew
        yield from loader
        epoch += 1


with distributed_session(enabled=True) as ctx:
    data = build_dataset(samples_per_task=args.samples, grid=32)
    torch.manual_seed(0)  # the initial weights: the same in every run
    model = build_model(grid=32, width=64).to(ctx.device)
    ddp = DistributedDataParallel(model)  # rank 0's initial weights on every rank
    powersgd = register_hook(ddp, "powersgd", ctx=ctx, options={"start_powersgd_iter": 2})
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=2e-3)
    sampler = MultiTaskDistributedSampler(
        data, num_replicas=ctx.world_size, rank=ctx.rank, mixing="balanced", seed=0, batch_size=16
    )
    # its own generator: a new epoch's iterator then draws nothing from the global RNG
    loader = DataLoader(data, batch_size=16, sampler=sampler, generator=torch.Generator())
    checkpoints = checkpointer(args.out, ctx=ctx, keep_last=2, async_save=True)

    window = LossWindow(TASKS, ctx.device)

    step = 0
    if (loaded := checkpoints.load_latest()) is not None:
        step = loaded.step
        model.load_state_dict(loaded.state["model"])
        optimizer.load_state_dict(loaded.state["optimizer"])
        sampler.load_state_dict(loaded.state["sampler"])
        if loaded.rank_state is not None:  # None when saved by another number of ranks
            powersgd.load_state_dict(loaded.rank_state["powersgd"])
            window.load_state_dict(loaded.rank_state["window"])  # the report under way
        log.info("resumed", step=step, rank=ctx.rank)

    def save() -> None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        state["sampler"] = sampler.state_dict()
        own = {"powersgd": powersgd.state_dict(), "window": window.state_dict()}
        checkpoints.save(state, step=step, rank_state=own)

    stop = False
    with Preemption(ctx) as preemption, Watchdog(ctx) as watchdog:
        stream = batches(loader, sampler)
        while step < args.steps and not stop:
            x, y, task = next(stream)  # taken only when stepped on: the sampler's state is exact
            watchdog.mark(step)
            per_sample = ((ddp(x.to(ctx.device)) - y.to(ctx.device)) ** 2).mean(dim=1)
            optimizer.zero_grad()
            per_sample.mean().backward()
            optimizer.step()
            window.add(per_sample, task)
            step += 1
            if step == int(os.environ.get("OWN_LOOP_DIE_AT", 0)) and ctx.restart_count == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # the restart test's crash, first run only
            if step % args.every == 0:
                metrics = window.report(ctx).result()  # every rank's samples, per task
                stop = decide(ctx, lambda: (args.out / "STOP").exists())
                if ctx.is_main:
                    log.info("step", step=step, **metrics)
                save()  # after all that changes state at this step, as a resume goes on from it
            stop = preemption.agreed() or stop  # a signal on any rank: all stop at this step
    if step % args.every:  # not saved at this step yet
        save()
    checkpoints.wait()
