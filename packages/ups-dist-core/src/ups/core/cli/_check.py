"""``ups check``: the proof, for a config's own model, step and data, that ``W`` ranks of batch
``b`` train as one process of batch ``W·b``, and ``k`` micro-batches of ``b`` as one batch of
``k·b``.

From the same seed, a few optimizer steps run three ways, each in a scratch folder (the run's
own folder is never touched; evaluation, the schedule and the ``plugins`` sections are left
out; one checkpoint, the last, is kept until its parameters are read):

- **A**: ``W`` ranks, each of ``b`` samples a micro-batch and ``k`` micro-batches a step (the
  config's ``training.batch_size`` and ``training.accumulation_steps``);
- **B**: one process of ``W·b`` samples, ``k`` micro-batches;
- **C**: one process of ``b`` samples, ``W·k`` micro-batches;
- **A-ddp**, under a strategy other than ``ddp`` (``zero``, ``fsdp``): A's ranks holding the
  whole model in DDP, so that sharding is shown to change nothing.

Their final parameters are compared, pairwise, against a tolerance. Before training,
:func:`examine` names what is known to break the equivalence, with its fix: BatchNorm,
dropout (the runs set it to ``p=0``, so the rest of the proof still holds), randomness in the
forward pass, a 0-d mean loss without a count, a training sampler that does not declare
``world_invariant``. A lossy comm hook is run as well as DDP's own all-reduce, and its
difference reported, not failed on; bf16 and fp16 runs in fp32 unless asked to keep it.
"""

from __future__ import annotations

import argparse
import gc
import math
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import structlog
import torch
from torch import nn
from torch.utils.data import default_collate

from ..checkpoint._commit import STATE_FILE
from ..config._config import CheckpointChoice, CommHookChoice, Config, StrategyChoice
from ..config._errors import UsageError
from ..config._user_code import load_object
from ..config._validate import select_sampler
from ..dist._collectives import Failure
from ..dist._context import launched
from ..dist._rng import seed_all
from ..engine._batches import to_device
from ..engine._loader import build_dataset
from ..engine._step import build_model, build_step
from ..launch._processes import train
from ..plugin._manager import Registry, load_plugins
from ..plugin._records import CommandRunner
from . import _common

log = structlog.get_logger()

Precision = Literal["fp32", "bf16", "fp16"]

LOSSY_HOOKS = frozenset({"bf16", "fp16", "powersgd", "batched_powersgd", "topk"})
"""The comm hooks (of ``ups-comm-hooks``) whose gradients differ from plain all-reduce's by
design: the check runs them besides ``none`` and reports the difference without failing."""

DROPOUT_OFF = "ups.core.cli._check:without_dropout"
"""The ``model.factory`` of the runs when the model has dropout: the config's model, with
``p=0``."""

LOSS_KINDS = {
    "samples": "yes ({}: one loss per sample)",
    "count": "yes ({}: (mean, count), every counted item weighs the same)",
    "mean": "no ({}: a 0-d mean without a count)",
    "other": "unknown ({}: neither one loss per sample, a 0-d mean nor (mean, count))",
}
"""What the step's loss is, as the report's ``loss per sample`` line says it."""


@attrs.frozen
class Breaker:
    """Something in the config that breaks the equivalence, and how to fix it."""

    what: str
    fix: str


@attrs.frozen
class Findings:
    """What :func:`examine` found before any run."""

    breakers: tuple[Breaker, ...]
    notes: tuple[str, ...]
    """What the runs change of the config, and why."""
    loss: str
    """The step's loss: a key of :data:`LOSS_KINDS`."""
    step: str
    """The step's class, as messages name it."""
    dropout: bool
    """Whether the model has dropout, which the runs turn off."""


@attrs.frozen
class Way:
    """One way of running the check's steps."""

    label: str
    processes: int
    batch_size: int
    accumulation_steps: int
    comm_hook: str
    """The comm hook the ranks use; ``-`` for one process (no DDP)."""
    strategy: str = "-"
    """The strategy the ranks use; ``-`` for one process (nothing to spread)."""


@attrs.frozen
class Outcome:
    """What one way's run left: the model's floating-point tensors after the last step, and
    the loss of the last report."""

    way: Way
    model: dict[str, torch.Tensor]
    loss: float | None


@attrs.frozen
class Comparison:
    """The largest absolute difference between two ways' final parameters (and buffers)."""

    first: str
    second: str
    difference: float
    counted: bool
    """Whether it decides the check; a lossy comm hook's is reported only."""


@attrs.frozen
class Report:
    """The check's outcome: its runs, their comparisons, what breaks equivalence."""

    outcomes: tuple[Outcome, ...]
    comparisons: tuple[Comparison, ...]
    findings: Findings
    notes: tuple[str, ...]
    """The findings' notes, and what happened in the runs (B out of memory)."""
    steps: int
    tolerance: float
    precision: str
    device: str

    def within(self, comparison: Comparison) -> bool:
        """Whether ``comparison`` agrees to the tolerance (NaN does not)."""
        return comparison.difference <= self.tolerance

    @property
    def exact(self) -> bool:
        """Whether every comparison that counts agrees and nothing breaks equivalence."""
        agree = all(self.within(c) for c in self.comparisons if c.counted)
        return agree and not self.findings.breakers

    def render(self, source: str) -> str:
        """The report as ``ups check`` prints it: the runs, the comparisons, the loss, what
        breaks equivalence with its fix, notes, and a closing verdict."""
        a = self.outcomes[0].way
        lines = [
            f"ups check {source}: {a.processes} ranks, {self.steps} steps, "
            f"{self.precision} on {self.device}",
            "",
        ]
        last = f"LOSS AT STEP {self.steps}"
        runs = [("RUN", "PROCESSES", "BATCH", "MICRO-BATCHES", "STRATEGY", "COMM HOOK", last)]
        for o in self.outcomes:
            w = o.way
            loss = "-" if o.loss is None else f"{o.loss:.6g}"
            runs.append(
                (
                    w.label,
                    str(w.processes),
                    str(w.batch_size),
                    str(w.accumulation_steps),
                    w.strategy,
                    w.comm_hook,
                    loss,
                )
            )
        lines += _table(runs)
        lines.append("")
        compared = [("COMPARISON", "MAX ABS DIFFERENCE", f"WITHIN {self.tolerance:g}")]
        for c in self.comparisons:
            verdict = ("yes" if self.within(c) else "no") if c.counted else "reported only"
            compared.append((f"{c.first} vs {c.second}", _number(c.difference), verdict))
        lines += _table(compared)
        loss = LOSS_KINDS[self.findings.loss].format(f"{self.findings.step}.loss")
        lines += ["", f"loss per sample: {loss}"]
        if self.findings.breakers:
            lines.append("breaks equivalence:")
            for breaker in self.findings.breakers:
                lines += [f"  - {breaker.what}", f"    fix: {breaker.fix}"]
        else:
            lines.append("breaks equivalence: nothing found")
        lines += [f"note: {note}" for note in self.notes]
        lines += ["", self._verdict()]
        return "\n".join(lines)

    def _verdict(self) -> str:
        if self.exact:
            a = self.outcomes[0].way
            w, b, k = a.processes, a.batch_size, a.accumulation_steps
            return (
                f"exact to {self.tolerance:g}: {w} ranks of batch {b} train as 1 process of "
                f"batch {w * b}, and {w * k} micro-batches of {b} as {k} of {w * b}"
            )
        why = [
            f"{c.first} vs {c.second} differ by {_number(c.difference)}"
            for c in self.comparisons
            if c.counted and not self.within(c)
        ]
        if self.findings.breakers:
            count = len(self.findings.breakers)
            why.append(
                f"{count} thing{'s' if count > 1 else ''} break{'' if count > 1 else 's'} it"
            )
        return f"not exact: {'; '.join(why)}"


def command(parser: argparse.ArgumentParser) -> CommandRunner:
    """Add ``ups check``'s arguments to ``parser``; return what runs it."""
    parser.add_argument("config", type=Path)
    parser.add_argument(
        "--nproc",
        type=_common.count,
        metavar="W",
        help="ranks to compare (default: distributed.nproc, at least 2)",
    )
    parser.add_argument(
        "--steps", type=_common.count, default=5, metavar="N", help="optimizer steps (default: 5)"
    )
    parser.add_argument(
        "--tolerance",
        type=_tolerance,
        default=1e-5,
        metavar="T",
        help="the largest parameter difference that agrees (default: 1e-5)",
    )
    parser.add_argument(
        "--keep-precision",
        action="store_true",
        help="run training.precision as configured (bf16, fp16), not fp32",
    )
    _common.add_overrides(parser)
    return _check


def _tolerance(text: str) -> float:
    """``ups check --tolerance``: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, not {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def _check(args: argparse.Namespace) -> int:
    """``ups check``: the three ways of running a few steps, compared (:func:`check`); exit 0
    when they agree and nothing breaks equivalence, else 1."""
    config = _common.run_config(args)
    nproc = args.nproc or max(config.distributed.nproc, 2)
    if nproc < 2:
        raise UsageError("--nproc: must be >= 2: one process has nothing to compare")
    if launched():
        raise UsageError("ups check starts its own processes: run it outside torchrun and srun")
    registry = load_plugins()
    _common.check_config(config, registry, nproc)
    report = check(
        config,
        registry,
        nproc=nproc,
        steps=args.steps,
        tolerance=args.tolerance,
        keep_precision=args.keep_precision,
    )
    print(report.render(str(args.config)))
    return _common.EXIT_OK if report.exact else _common.EXIT_FAILED


def check(
    config: Config,
    registry: Registry,
    *,
    nproc: int,
    steps: int = 5,
    tolerance: float = 1e-5,
    keep_precision: bool = False,
) -> Report:
    """Run ``steps`` optimizer steps of ``config`` the three ways (A on ``nproc`` local
    processes, B and C in this one), in a scratch folder, and compare them.

    :raises torch.distributed.elastic.multiprocessing.errors.ChildFailedError: when a rank of
        A fails (as ``ups train --nproc`` would).
    """
    findings = examine(config, registry, keep_precision=keep_precision)
    t = config.training
    b, k = t.batch_size, t.accumulation_steps
    hook, strategy = config.comm_hook.name, config.strategy.name
    lossy = hook in LOSSY_HOOKS
    ways = [Way("A", nproc, b, k, "none" if lossy else hook, strategy)]
    if lossy:
        ways.append(Way("A+hook", nproc, b, k, hook, strategy))
    if strategy != "ddp":  # the same ranks, as DDP holds the model: sharding changes nothing
        ways.append(Way("A-ddp", nproc, b, k, "none", "ddp"))
    ways += [Way("B", 1, nproc * b, k, "-"), Way("C", 1, b, nproc * k, "-")]
    precision: Precision = t.precision if keep_precision else "fp32"
    notes = list(findings.notes)
    outcomes: dict[str, Outcome] = {}
    with tempfile.TemporaryDirectory(prefix="ups-check-") as scratch:
        for way in ways:
            runs = _scratch(config, way, Path(scratch), steps, precision, findings.dropout)
            log.info(
                "check: training",
                run=way.label,
                processes=way.processes,
                batch_size=way.batch_size,
                accumulation_steps=way.accumulation_steps,
            )
            outcome = _attempt(runs, way)
            if outcome is not None:
                outcomes[way.label] = outcome
                continue
            _free()
            notes.append(
                f"B (1 process x {way.batch_size}) ran out of memory: left out; C, "
                "accumulation on one process, is the reference"
            )
    pairs = [("A", "B"), ("A", "C"), ("B", "C"), ("A", "A-ddp"), ("A+hook", "A")]
    comparisons = tuple(
        Comparison(x, y, _difference(outcomes[x].model, outcomes[y].model), counted=x != "A+hook")
        for x, y in pairs
        if x in outcomes and y in outcomes
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return Report(
        outcomes=tuple(outcomes.values()),
        comparisons=comparisons,
        findings=findings,
        notes=tuple(notes),
        steps=steps,
        tolerance=tolerance,
        precision=precision,
        device=device,
    )


def examine(config: Config, registry: Registry, *, keep_precision: bool = False) -> Findings:
    """What in ``config`` breaks the equivalence, found without training: the model scanned
    for BatchNorm and dropout, then (on this process's device, dropout off) two samples of the
    data through the step twice, from two seeds, for the kind of its loss and randomness left
    in the forward pass; the training sampler's record; the comm hook and the precision."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    breakers: list[Breaker] = []
    notes: list[str] = []
    seed_all(config.run.seed)
    model = build_model(config)
    norms = _named(model, lambda m: isinstance(m, nn.modules.batchnorm._BatchNorm))
    if norms:
        fix = (
            "distributed.sync_batchnorm: true (statistics over the ranks; still per "
            "micro-batch with accumulation), or GroupNorm or LayerNorm"
            if device.type == "cuda"
            else "GroupNorm or LayerNorm (DDP refuses SyncBatchNorm on CPU)"
        )
        breakers.append(
            Breaker(f"BatchNorm ({norms}): statistics per rank and per micro-batch", fix)
        )
    dropouts = _named(model, _has_dropout)
    if dropouts:
        breakers.append(
            Breaker(
                f"Dropout ({dropouts}): draws different masks per rank (every rank from the "
                "same seed, each for its own part of the batch)",
                "none, if masks drawn otherwise will do; the runs set p=0, so the comparisons "
                "above prove the rest",
            )
        )
        turn_off_dropout(model)
    step = build_step(config)
    name = type(step).__qualname__
    kind, stochastic = _probe(config, step, model.to(device), device)
    del model
    _free()
    if stochastic:
        breakers.append(
            Breaker(
                f"the forward pass ({name}.forward) draws random numbers in training, dropout "
                "modules aside: every rank draws the same ones for its own part of the batch",
                "nn.Dropout modules (the check turns them off), or randomness seeded per "
                "sample in the data",
            )
        )
    if kind == "mean":
        breakers.append(
            Breaker(
                f"{name}.loss returns a 0-d mean without a count: uneven micro-batches (an "
                "epoch's last) weigh each micro-batch alike, not each sample",
                "return one loss per sample, or (mean, count)",
            )
        )
    sampler, _ = select_sampler(registry, config.sampler, "sampler", exact=False, factory=False)
    if not sampler.world_invariant:
        breakers.append(
            Breaker(
                f"sampler {config.sampler.name!r} does not declare world_invariant: its global "
                "batch may depend on the number of ranks",
                "a sampler that declares it (torch, tensor, multitask), or world_invariant=True "
                "in its plugin's record if W ranks of b take the samples of 1 process of W*b",
            )
        )
    hook = config.comm_hook.name
    if hook in LOSSY_HOOKS:
        notes.append(
            f"comm_hook {hook!r} is lossy: A ran with 'none', A+hook with {hook!r} "
            "(its difference is reported, not failed on)"
        )
    precision = config.training.precision
    if precision != "fp32":
        notes.append(
            f"training.precision {precision} kept: the differences include its rounding"
            if keep_precision
            else f"ran in fp32, not training.precision {precision} (--keep-precision keeps it)"
        )
    if config.schedule:
        notes.append(f"the schedule's {len(config.schedule)} rules are left out of the runs")
    return Findings(tuple(breakers), tuple(notes), kind, name, bool(dropouts))


def without_dropout(factory: str, options: Mapping[str, Any]) -> Any:
    """The runs' ``model.factory`` for a model with dropout: ``factory(**options)`` with every
    dropout turned off (:func:`turn_off_dropout`)."""
    model = load_object(factory, "model.factory")(**options)
    if isinstance(model, nn.Module):
        turn_off_dropout(model)
    return model


def turn_off_dropout(model: nn.Module) -> None:
    """Set ``p=0`` in every dropout module of ``model``, and ``dropout=0`` in its attention."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        elif isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0


def _has_dropout(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    return isinstance(module, nn.MultiheadAttention) and module.dropout > 0


def _named(model: nn.Module, kind: Callable[[nn.Module], bool]) -> str:
    """The modules of ``model`` of ``kind``: their classes and where they are (three places at
    most), ``BatchNorm1d at 1, 4``; ``""`` if none."""
    found = [(name or "the model", m) for name, m in model.named_modules() if kind(m)]
    if not found:
        return ""
    shown = ", ".join(name for name, _ in found[:3])
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    classes = ", ".join(sorted({type(m).__name__ for _, m in found}))
    return f"{classes} at {shown}{more}"


def _probe(config: Config, step: Any, model: nn.Module, device: torch.device) -> tuple[str, bool]:
    """Two samples of the data through ``step`` and ``model`` in training mode, twice, from two
    seeds: the kind of loss it returns (a key of :data:`LOSS_KINDS`) and whether the two
    passes differ (randomness in the forward pass)."""
    dataset = build_dataset(config.data, "data")
    size = min(config.training.batch_size, 2, len(dataset))
    spec = config.data.loader.collate
    collate = load_object(spec, "data.loader.collate") if spec else default_collate
    batch = to_device(collate([dataset[i] for i in range(size)]), device)
    model.train()
    losses = []
    cuda = [torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        for seed in (1, 2):
            torch.manual_seed(seed)
            losses.append(step.loss(step.forward(model, batch), batch))
    first, second = _value(losses[0]), _value(losses[1])
    differ = first is not None and second is not None and not torch.allclose(first, second)
    return _kind(losses[0]), differ


def _kind(returned: Any) -> str:
    if isinstance(returned, tuple) and len(returned) == 2 and isinstance(returned[1], int):
        return "count"
    if isinstance(returned, torch.Tensor) and returned.dim() in (0, 1):
        return "mean" if returned.dim() == 0 else "samples"
    return "other"


def _value(returned: Any) -> torch.Tensor | None:
    """The loss tensor in what ``Step.loss`` returned, detached, as float."""
    loss = returned[0] if isinstance(returned, tuple) and returned else returned
    return loss.detach().float() if isinstance(loss, torch.Tensor) else None


def _scratch(
    config: Config, way: Way, folder: Path, steps: int, precision: Precision, dropout: bool
) -> Config:
    """``config`` as ``way`` runs it: ``steps`` optimizer steps into ``folder/<label>``, one
    checkpoint at the end, no evaluation, schedule, plugin sections, restarts or preemption
    signals, out-of-memory errors raised (a skipped step would compare other steps)."""
    t, d = config.training, config.distributed
    model = config.model
    if dropout:
        model = attrs.evolve(
            model,
            factory=DROPOUT_OFF,
            options={"factory": model.factory, "options": model.options},
        )
    return attrs.evolve(
        config,
        run=attrs.evolve(
            config.run, name=way.label, output_dir=str(folder), log_every=steps, profile_steps=None
        ),
        model=model,
        eval=None,
        training=attrs.evolve(
            t,
            batch_size=way.batch_size,
            accumulation_steps=way.accumulation_steps,
            max_steps=steps,
            epochs=max(t.epochs, steps),  # every epoch has a step at least
            precision=precision,
            skip_oom=False,
        ),
        distributed=attrs.evolve(
            d,
            enabled=way.processes > 1,
            nproc=way.processes,
            max_restarts=0,
            desync_check_every=None,
        ),
        comm_hook=CommHookChoice(name=way.comm_hook, options=config.comm_hook.options)
        if way.comm_hook == config.comm_hook.name
        else CommHookChoice(),
        strategy=config.strategy if way.strategy == config.strategy.name else StrategyChoice(),
        checkpoint=CheckpointChoice(name="simple", options={"keep_last": 1}, preempt_signals=()),
        schedule=(),
        plugins={},
    )


def _attempt(config: Config, way: Way) -> Outcome | None:
    """Train ``config`` on ``way``'s processes; ``None`` if it is B and ran out of memory."""
    try:
        return _train(config, way)
    except Exception as error:
        if way.label != "B" or not Failure.of(0, error).out_of_memory:
            raise
    return None


def _train(config: Config, way: Way) -> Outcome:
    """Train ``config`` on ``way``'s processes; its final model's floating-point tensors."""
    result = train(config, nproc=way.processes)
    assert result.checkpoint is not None  # a run saves at its end
    state = torch.load(Path(result.checkpoint) / STATE_FILE, weights_only=True)["model"]
    model = {n: v for n, v in state.items() if torch.is_tensor(v) and v.is_floating_point()}
    return Outcome(way, model, result.losses[-1] if result.losses else None)


def _difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The largest absolute difference of two models' tensors (NaN if one is not finite)."""
    largest = 0.0
    for name, x in a.items():
        gap = float((x.double() - b[name].double()).abs().max()) if x.numel() else 0.0
        if math.isnan(gap):
            return math.nan
        largest = max(largest, gap)
    return largest


def _number(value: float) -> str:
    return "0" if value == 0 else f"{value:.2e}"


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    """``rows`` as lines of left-aligned columns two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def _free() -> None:
    """Hand back what a dropped model or failed run held: garbage collected, and on CUDA the
    allocator's cache emptied."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
