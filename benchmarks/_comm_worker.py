"""One rank of ``bench_comm.py``, run by it inside its network namespace (``ip netns exec``).

Usage (by the driver only): ``python benchmarks/_comm_worker.py CONFIG_JSON``, with
``MASTER_ADDR``, ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME`` (the veth end in this namespace) in
the environment. ``CONFIG_JSON`` holds ``rank``, ``ifname``, ``hooks`` (a list of ``{"label",
"name", "options"}``), ``width``, ``layers``, ``batch``, ``warmup``, ``steps``, ``rounds``,
``threads`` and ``timeout_s``.

It joins a gloo process group of two, builds one model per hook (the same MLP, the same seed on
both ranks), wraps each in DDP and registers the hook through the plugin registry as the engine
does (``registry.select("comm_hook", ...)`` then ``record.factory(ddp, ctx=ctx,
options=options)``), warms every hook up, then runs ``rounds`` rounds: a timed plain
``dist.all_reduce`` of the model's float32 gradient bytes (the link probe), and each hook's
``steps`` timed training steps, in the given order in even rounds and reversed in odd ones. Per
timed block: every step's time, the bytes the hook handed to collectives per step (see
:func:`Meter.take`) and the bytes this namespace's veth sent and received (its
``/sys/class/net/IF/statistics`` counters, which ``ip netns exec`` shows for this namespace).
The result is one JSON line on stdout; progress goes to stderr (rank 0 only).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ups.core import RunContext, load_plugins

START_OPTIONS = ("start_powersgd_iter", "start_iter")
"""Options of a hook that name the steps it all-reduces plainly before compressing."""


def wire(ifname: str) -> dict[str, int]:
    """The bytes the veth end ``ifname`` has sent and received so far (0 when unreadable)."""
    counters = {}
    for key in ("tx_bytes", "rx_bytes"):
        path = Path("/sys/class/net") / ifname / "statistics" / key
        try:
            counters[key] = int(path.read_text())
        except (OSError, ValueError):
            counters[key] = 0
    return counters


def build_model(width: int, layers: int) -> nn.Module:
    """``layers`` Linear(width, width), ReLU between them; the same weights on every rank."""
    torch.manual_seed(0)
    parts: list[nn.Module] = []
    for i in range(layers):
        if i:
            parts.append(nn.ReLU())
        parts.append(nn.Linear(width, width))
    return nn.Sequential(*parts)


class Meter:
    """The bytes a hook hands to collectives per step, from the best source its state offers."""

    def __init__(self, name: str, state: object, grad_bytes: int) -> None:
        self.name = name
        self.state = state
        self.grad_bytes = grad_bytes
        self._numel = self._powersgd_numel()

    def _powersgd_numel(self) -> int | None:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        inner = getattr(self.state, "powersgd", self.state)
        if isinstance(inner, PowerSGDState):
            return int(inner.total_numel_after_compression)
        return None

    def take(self, steps: int) -> tuple[float | None, str]:
        """Bytes per step over the last ``steps`` steps, and where they come from:

        - ``comm_metrics``: the state counts them (every hook of ups-comm-hooks that derives
          from ``Traffic``); the call starts its count anew;
        - ``numel x 4``: ``none``, DDP's own all-reduce of the float32 gradients;
        - ``PowerSGDState``: a state holding torch's ``PowerSGDState`` (as ``powersgd`` does, or
          being one): its count of elements after compression (P and Q, and the tensors sent
          uncompressed), times 4 bytes (float32 gradients);
        - otherwise none (the veth counters still tell).
        """
        metrics = getattr(self.state, "comm_metrics", None)
        if callable(metrics):
            return float(metrics(steps)["comm_bytes"]), "comm_metrics"
        if self.name == "none":
            return self.grad_bytes, "numel x 4"
        if self._numel is not None:
            before, self._numel = self._numel, self._powersgd_numel()
            assert self._numel is not None
            return (self._numel - before) * 4 / steps, "PowerSGDState"
        return None, "unknown"


class Subject:
    """One hook: its DDP model, hook state, optimizer, data and byte meter."""

    def __init__(self, hook: dict[str, Any], cfg: dict[str, Any], ctx: RunContext, registry: Any):
        self.label = hook["label"]
        model = build_model(cfg["width"], cfg["layers"])
        # Same seed, same weights on both ranks: skip DDP's broadcast of them (50 MB, seconds on
        # the slow link, per model).
        self.ddp = DistributedDataParallel(model, init_sync=False)
        record, options = registry.select("comm_hook", hook["name"], hook["options"], "comm_hook")
        self.state = record.factory(self.ddp, ctx=ctx, options=options)
        # Past the steps a hook all-reduces plainly before it starts compressing.
        plain = max(int(getattr(options, key, 0)) for key in START_OPTIONS)
        self.warmup = cfg["warmup"] + plain
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(1 + ctx.rank)  # each rank its own batch
        self.x = torch.randn(cfg["batch"], cfg["width"], generator=generator)
        self.y = torch.randn(cfg["batch"], cfg["width"], generator=generator)
        params = [p for p in model.parameters() if p.requires_grad]
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        self.meter = Meter(hook["name"], self.state, grad_bytes)

    def step(self) -> float:
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        F.mse_loss(self.ddp(self.x), self.y).backward()
        self.optimizer.step()
        return time.perf_counter() - started


def probe(tensor: torch.Tensor, ifname: str) -> dict[str, Any]:
    """One timed plain ``dist.all_reduce`` of ``tensor`` (float32), with the veth's bytes."""
    dist.barrier()
    before = wire(ifname)
    started = time.perf_counter()
    dist.all_reduce(tensor)
    seconds = time.perf_counter() - started
    after = wire(ifname)
    return {
        "seconds": seconds,
        "bytes": tensor.numel() * tensor.element_size(),
        **{key: after[key] - before[key] for key in before},
    }


def main() -> int:
    cfg = json.loads(sys.argv[1])
    rank, ifname = cfg["rank"], cfg["ifname"]
    torch.set_num_threads(cfg["threads"])
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if rank == 0 else (lambda _: None)
    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=cfg["timeout_s"]),
    )
    subjects: list[Subject] = []
    try:
        # Each rank alone in its namespace, as on a machine of its own.
        ctx = RunContext(
            rank=rank,
            world_size=2,
            node_rank=rank,
            backend="gloo",
            timeout_s=cfg["timeout_s"],
        )
        registry = load_plugins()
        subjects += [Subject(hook, cfg, ctx, registry) for hook in cfg["hooks"]]
        grad_numel = sum(p.numel() for p in subjects[0].ddp.parameters())
        flat = torch.zeros(grad_numel)
        probe(flat, ifname)  # gloo's first all-reduce of this size: untimed
        for subject in subjects:
            for _ in range(subject.warmup):
                subject.step()
            subject.meter.take(subject.warmup)  # start counting anew
        say(f"    warmed up ({', '.join(s.label for s in subjects)})")
        rounds = []
        for i in range(cfg["rounds"]):
            order = subjects if i % 2 == 0 else subjects[::-1]
            link = probe(flat, ifname)
            blocks = {}
            for subject in order:
                dist.barrier()
                before = wire(ifname)
                times = [subject.step() for _ in range(cfg["steps"])]
                after = wire(ifname)
                per_step, source = subject.meter.take(cfg["steps"])
                blocks[subject.label] = {
                    "step_s": times,
                    "bytes_per_step": per_step,
                    "bytes_source": source,
                    **{f"{k}_per_step": (after[k] - before[k]) / cfg["steps"] for k in before},
                }
            rounds.append({"order": [s.label for s in order], "probe": link, "hooks": blocks})
            say(
                f"    round {i + 1}/{cfg['rounds']}: probe {link['seconds']:.2f} s; "
                + ", ".join(
                    f"{label} {sorted(b['step_s'])[len(b['step_s']) // 2]:.3f} s"
                    for label, b in blocks.items()
                )
            )
        result = {
            "rank": rank,
            "params": grad_numel,
            "grad_bytes": subjects[0].meter.grad_bytes,
            "threads": torch.get_num_threads(),
            "rounds": rounds,
        }
        dist.barrier()
    finally:
        # Free the DDP reducers while Python is alive: freed at interpreter shutdown, gloo's
        # threads abort the process (as ups.core.distributed_session does).
        subjects.clear()
        gc.collect()
        dist.destroy_process_group()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
