"""Checks of a config against the plugins installed and the rules of sound DDP training.

Errors raise :class:`~ups.core.config._errors.ConfigError`; advice comes back as warnings. Checking
imports torch only where a check needs it (``ups validate`` of a config whose factories import
no torch answers without it): for CUDA with ``fp16`` or ``nccl``, for an optimizer or
scheduler name that :data:`TORCH_NAMES` lacks, and through the modules the config names.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint._best import KEY as KEEP_BEST
from ..checkpoint._best import keep_best
from ..checkpoint._files import check_writable
from ..checkpoint._weights import source_problem
from ..engine._schedule import schedule_warnings
from ..engine._step import build_step, has_metrics
from ..plugin._manager import Registry
from ..plugin._records import SamplerPlugin, StrategyPlugin
from ._config import Config, LoaderConfig, PluginChoice, stage_config, stage_refs
from ._errors import ConfigError, did_you_mean
from ._user_code import load_object

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

MIN_GLOBAL_BATCH = 16
"""Below this many samples per optimizer step over all ranks, gradients are mostly noise."""
TORCH_NAMES = {
    "training.optimizer": frozenset(
        [
            "adadelta",
            "adafactor",
            "adagrad",
            "adam",
            "adamax",
            "adamw",
            "asgd",
            "lbfgs",
            "muon",
            "nadam",
            "radam",
            "rmsprop",
            "rprop",
            "sgd",
            "sparseadam",
        ]
    ),
    "training.scheduler": frozenset(
        [
            "chainedscheduler",
            "constantlr",
            "cosineannealinglr",
            "cosineannealingwarmrestarts",
            "cycliclr",
            "exponentiallr",
            "lambdalr",
            "linearlr",
            "multiplicativelr",
            "multisteplr",
            "onecyclelr",
            "polynomiallr",
            "reducelronplateau",
            "sequentiallr",
            "steplr",
        ]
    ),
}
"""torch's optimizer and scheduler names as :mod:`ups.core.engine._optim` finds them in the torch that
CI pins (a test compares them), by the config key that names one."""


def validate(config: Config, registry: Registry, nproc: int | None = None) -> list[str]:
    """Check everything that can be checked without training; return warnings.

    Imports the model and data factories, checks every plugin section's name and options,
    probes that the run's folder and the checkpoint backend's place can be written (a file
    or object made and removed: nothing is left, no folder made), and applies seed 001's
    rules for multi-process and multi-task runs.

    :param nproc: processes per machine if it differs from ``distributed.nproc`` (``--nproc``).
    :raises ConfigError: at the first key whose value cannot work.
    """
    if config.stages:
        return _validate_stages(config, registry, nproc)
    load_object(config.model.factory, "model.factory")
    init_from = config.model.init_from
    path = None if init_from is None else init_from.path
    if (
        init_from is not None
        and path is not None
        and (found := source_problem(Path(path), init_from.weights))
    ):
        raise ConfigError("model.init_from", found)
    load_object(config.data.factory, "data.factory")
    if config.eval is not None:
        load_object(config.eval.factory, "eval.factory")
    step = build_step(config)
    check_loader(config.data.loader)
    # The plugins' options only: their factories' modules are imported by the run.
    sampler, _ = select_sampler(registry, config.sampler, "sampler", exact=False, factory=False)
    if config.eval is not None:
        select_sampler(registry, config.eval.sampler, "eval.sampler", exact=True, factory=False)
    comm, ckpt, launch = config.comm_hook, config.checkpoint, config.launch
    registry.select("comm_hook", comm.name, comm.options, "comm_hook", factory=False)
    strategy, _ = registry.select(
        "strategy", config.strategy.name, config.strategy.options, "strategy", factory=False
    )
    check_strategy(config, strategy)
    backend, ckpt_options = registry.select(
        "checkpoint", ckpt.name, ckpt.options, "checkpoint", factory=False
    )
    if launch.name is not None:
        registry.select("launcher", launch.name, launch.options, "launch", factory=False)
    registry.check_sections(config)

    t = config.training
    check_name(t.optimizer, "training.optimizer")
    if t.scheduler is not None:
        check_name(t.scheduler, "training.scheduler")
    if t.precision == "fp16" and not _cuda_devices():
        raise ConfigError(
            "training.precision",
            "'fp16' needs CUDA (its gradient scaler runs there) and this machine has none; "
            "allowed here: fp32, bf16",
        )

    check_writable(config.run_dir, "run.output_dir", "the run's folder")
    if backend.probe is not None:
        backend.probe(directory=config.run_dir, options=ckpt_options)
    nproc = config.distributed.nproc if nproc is None else nproc
    if config.distributed.backend == "nccl" and (devices := _cuda_devices()) < nproc:
        raise ConfigError(
            "distributed.backend",
            f"'nccl' needs a CUDA device per process; this machine has {devices} "
            f"for {nproc} processes; allowed here: auto, gloo",
        )
    check_sync_batchnorm(config, nproc)
    if config.eval is None or config.eval.every_steps is None:
        for i, rule in enumerate(config.schedule):
            if rule.when.val_loss_below is not None:
                raise ConfigError(
                    f"schedule[{i}].when.val_loss_below",
                    "needs an evaluation loss during training, and this run evaluates at the "
                    "end only, if at all; set eval.every_steps, or use at_latest_step",
                )
            if rule.when.plateau is not None:
                raise ConfigError(
                    f"schedule[{i}].when.plateau",
                    "counts evaluations during training, and this run evaluates at the end "
                    "only, if at all; set eval.every_steps",
                )
    metrics = config.metrics is not None or has_metrics(step)
    check_plateaus(config, metrics=metrics)
    check_keep_best(config, metrics=metrics)
    warnings = schedule_warnings(config.schedule, max_steps=t.max_steps)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cores and nproc > cores:
        warnings.append(
            f"distributed.nproc: {nproc} processes on {cores} CPU cores oversubscribe them: the "
            f"ranks slow each other down; at most {cores} on this machine"
        )
    if nproc > 1 and len(config.data.tasks) > 1 and not sampler.multi_task:
        warnings.append(
            f"sampler.name: {config.sampler.name!r} treats the {len(config.data.tasks)} tasks of "
            "data.tasks as one flat list, so ranks see unbalanced task mixes; choose a sampler "
            "that balances tasks (its plugin declares multi_task=True)"
        )
    if not sampler.world_invariant:
        warnings.append(
            f"sampler.name: {config.sampler.name!r} does not declare that its global batch is "
            "the same on any number of ranks (world_invariant), so W ranks of batch b need not "
            "train as one process of batch W*b (`ups check` tells); torch, tensor and "
            "multitask keep it"
        )
    global_batch = config.training.batch_size * nproc
    if nproc > 1 and global_batch < MIN_GLOBAL_BATCH:
        warnings.append(
            f"training.batch_size: {config.training.batch_size} per rank x {nproc} ranks = "
            f"{global_batch} samples per step, under {MIN_GLOBAL_BATCH}"
        )
    if nproc == 1 and config.comm_hook.name != "none":
        warnings.append(f"comm_hook.name: {config.comm_hook.name!r} has no effect on one process")
    return warnings


def check_strategy(config: Config, strategy: StrategyPlugin) -> None:
    """Refuse what the chosen strategy cannot do: a DDP comm hook where it has no DDP reducer,
    agreeing on out-of-memory where a rank cannot skip a pass the others gather for.

    :raises ConfigError: naming ``comm_hook.name`` or ``training.skip_oom``.
    """
    name = config.strategy.name
    if config.comm_hook.name != "none" and not strategy.comm_hooks:
        instead = f"; instead: {strategy.instead}" if strategy.instead else ""
        raise ConfigError(
            "comm_hook.name",
            f"{config.comm_hook.name!r} hooks DDP's gradient all-reduce, which strategy "
            f"{name!r} does not run; allowed: 'none'{instead}",
        )
    if config.training.skip_oom is True and not strategy.local_passes:
        raise ConfigError(
            "training.skip_oom",
            f"cannot hold under strategy {name!r}: a rank out of memory cannot skip a forward "
            "the other ranks gather parameters for; allowed: false, auto (off under it)",
        )


def _validate_stages(config: Config, registry: Registry, nproc: int | None) -> list[str]:
    """:func:`validate` each stage's config, as its training takes it (a ``{stage: NAME}``
    factory option as the model NAME's config builds); its errors and warnings at
    ``stages[i].KEY``."""
    warnings = []
    for index in range(len(config.stages)):
        staged = stage_config(config, index)
        try:
            if any(stage_refs(staged)):  # torch, for a factory given an earlier stage's model
                from ..engine._stages import runnable

                staged = runnable(config, index, torch_cpu(), trained=False)
            found = validate(staged, registry, nproc)
        except ConfigError as error:
            raise ConfigError(f"stages[{index}].{error.path}", error.problem) from None
        warnings += [f"stages[{index}].{warning}" for warning in found]
    return warnings


def torch_cpu() -> Any:
    """torch's CPU device, torch imported only now."""
    import torch

    return torch.device("cpu")


def check_plateaus(config: Config, *, metrics: bool) -> None:
    """Refuse what watches a plateau and cannot work: a ``ReduceLROnPlateau`` scheduler
    without evaluations during training, with a plateau rule that changes the LR too, and a
    plateau rule's or the scheduler's ``monitor`` that the evaluation never reports (with
    ``metrics``, the run's metrics' names are known at the first evaluation only, which
    checks them then).

    :raises ConfigError: naming the key.
    """
    t = config.training
    monitors = [
        (f"schedule[{i}].when.plateau.monitor", rule.when.plateau.monitor)
        for i, rule in enumerate(config.schedule)
        if rule.when.plateau is not None
    ]
    if plateau_scheduler(t.scheduler):
        if config.eval is None or config.eval.every_steps is None:
            raise ConfigError(
                "training.scheduler",
                f"{t.scheduler!r} steps after each evaluation during training, and this run "
                "evaluates at the end only, if at all; set eval.every_steps",
            )
        for i, rule in enumerate(config.schedule):
            if rule.when.plateau is not None and rule.do.lr_multiplier is not None:
                raise ConfigError(
                    "training.scheduler",
                    f"{t.scheduler!r} and schedule[{i}] (a plateau rule with lr_multiplier) "
                    "both change the LR on a plateau; keep one",
                )
        monitor = t.scheduler_options.get("monitor", "val_loss")
        monitors.append(("training.scheduler_options.monitor", monitor))
    for key, monitor in monitors:
        check_monitor(config, key, monitor, metrics=metrics)


def check_keep_best(config: Config, *, metrics: bool) -> None:
    """Refuse a ``checkpoint.options.keep_best`` without an evaluation (``eval: null``), or
    monitoring a value the evaluation never reports (see :func:`check_monitor`).

    :raises ConfigError: naming the key.
    """
    keep = keep_best(config.checkpoint.options)
    if keep is None:
        return
    if config.eval is None:
        raise ConfigError(
            KEEP_BEST,
            "ranks checkpoints by an evaluated value, and this run has no evaluation "
            "(eval: null); set eval, or drop keep_best",
        )
    check_monitor(config, f"{KEEP_BEST}.monitor", keep.monitor, metrics=metrics)


def check_monitor(config: Config, key: str, monitor: str, *, metrics: bool) -> None:
    """Refuse a ``monitor`` at ``key`` that the run's evaluation never reports, naming what
    it does report (with ``metrics``, the names of the run's metrics are known at the first
    evaluation only, which checks them then: any ``val_<name>`` passes here).

    :raises ConfigError: naming ``key``.
    """
    tasks = config.data.tasks
    known = {"val_loss", "val_samples"} | {f"val_loss/{task}" for task in tasks if len(tasks) > 1}
    if monitor in known or (metrics and monitor.startswith("val_")):
        return
    also = ", val_<metric> for each metric the step reports" if metrics else ""
    raise ConfigError(
        key,
        f"{monitor!r} is not reported by the run's evaluation; it reports: "
        f"{', '.join(sorted(known))}{also}{did_you_mean(monitor, known)}",
    )


def plateau_scheduler(name: str | None) -> bool:
    """Whether ``training.scheduler`` names a ``ReduceLROnPlateau`` (stepped after
    evaluations); imports torch only for an import path."""
    if name is None or ":" not in name:
        return name is not None and name.lower() == "reducelronplateau"
    from torch.optim.lr_scheduler import ReduceLROnPlateau

    cls = load_object(name, "training.scheduler")
    return isinstance(cls, type) and issubclass(cls, ReduceLROnPlateau)


def check_name(name: str, key: str) -> None:
    """Check the optimizer or scheduler name at ``key`` (``training.optimizer`` or
    ``training.scheduler``) as building it will resolve it; a name of :data:`TORCH_NAMES`
    passes without importing torch, unless torch is imported already (a torch older than CI's
    that lacks it then fails when the run builds it).

    :raises ConfigError: naming ``key``, the names allowed and the nearest one.
    """
    if ":" not in name and name.lower() in TORCH_NAMES[key] and "torch" not in sys.modules:
        return
    from ..engine._optim import OPTIMIZERS, SCHEDULERS, resolve

    resolve(name, OPTIMIZERS if key == "training.optimizer" else SCHEDULERS, key)


def check_sync_batchnorm(config: Config, nproc: int) -> None:
    """Refuse ``distributed.sync_batchnorm`` where a rank would compute on the CPU, whose
    DDP refuses SyncBatchNorm layers: with ``gloo`` chosen, or fewer CUDA devices than the
    ``nproc`` processes of this machine (``auto`` gives those beyond them the CPU). One
    process without a process group (``distributed.enabled`` not ``true``) converts nothing,
    so nothing is refused.

    :raises ConfigError: naming ``distributed.sync_batchnorm``, and what is allowed here.
    """
    d = config.distributed
    if not d.sync_batchnorm or d.enabled is False or (nproc == 1 and d.enabled is not True):
        return
    devices = 0 if d.backend == "gloo" else _cuda_devices()
    if devices < nproc:
        where = (
            "distributed.backend 'gloo' puts every rank"
            if d.backend == "gloo"
            else f"this machine has {devices} CUDA devices for {nproc} processes, which puts ranks"
        )
        raise ConfigError(
            "distributed.sync_batchnorm",
            f"SyncBatchNorm runs on CUDA only (DDP refuses it on the CPU), and {where} on the "
            "CPU; allowed here: false (GroupNorm or LayerNorm normalise alike on any number "
            "of ranks)",
        )


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def check_loader(options: LoaderConfig) -> None:
    """Refuse loader options that cannot work together.

    :raises ConfigError: naming the ``data.loader`` key.
    """
    if options.num_workers == 0:
        for key in ("prefetch_factor", "persistent_workers", "multiprocessing_context"):
            if getattr(options, key) not in (None, False):
                raise ConfigError(
                    f"data.loader.{key}", "needs worker processes; set data.loader.num_workers > 0"
                )
    if options.collate is not None:
        load_object(options.collate, "data.loader.collate")


def check_data(
    config: Config, train: DataLoader[Any], evaluation: DataLoader[Any] | None, world_size: int
) -> None:
    """Refuse data that the run cannot use, once the engine has built its loaders: a training
    set that gives this rank no batch, so no step (empty, or fewer samples than ranks with a
    sampler that drops the rest), and an empty evaluation set. The samplers deal every rank
    as many training batches, so every rank refuses alike.

    :raises ConfigError: naming ``data.factory`` or ``eval.factory``, the samples it gave and
        how many would do.
    """
    samples = len(train.dataset)  # type: ignore[arg-type]
    if len(train) == 0:
        allowed = "at least 1 sample"
        if world_size > 1:
            allowed += f", and {world_size} (one per rank) for a sampler that drops the rest"
        raise ConfigError(
            "data.factory",
            f"returned {samples} samples, of which the {config.sampler.name!r} sampler deals no "
            f"batch to this rank (of {world_size}): the run would take no step; allowed: "
            f"{allowed}",
        )
    if evaluation is not None and len(evaluation.dataset) == 0:  # type: ignore[arg-type]
        raise ConfigError(
            "eval.factory", "returned 0 samples: nothing to evaluate; allowed: at least 1 sample"
        )


def select_sampler(
    registry: Registry, choice: PluginChoice, key: str, *, exact: bool, factory: bool = True
) -> tuple[SamplerPlugin, Any]:
    """The sampler plugin ``choice`` names and its options, for training (``exact=False``:
    every rank the same number of samples) or for evaluation (``exact=True``: every sample
    once); with ``factory=False``, its factory not imported (:meth:`Registry.get`).

    :raises ConfigError: naming ``key``, for an unknown sampler or one of the other kind.
    """
    fits = sorted(
        name
        for name, provided in registry.records("sampler").items()
        if isinstance(provided.record, SamplerPlugin) and provided.record.exact == exact
    )
    registry.get("sampler", choice.name, f"{key}.name", offer=fits, factory=False)  # unknown?
    record, options = registry.select("sampler", choice.name, choice.options, key, factory=factory)
    if record.exact != exact:
        kind = (
            "gives every sample to one rank, so ranks may take different numbers of steps"
            if record.exact
            else "pads the ranks' shares to one length, so some samples would count twice"
        )
        raise ConfigError(
            f"{key}.name",
            f"{choice.name!r} {kind}; allowed for {'evaluation' if exact else 'training'}: "
            + ", ".join(fits),
        )
    return record, options
