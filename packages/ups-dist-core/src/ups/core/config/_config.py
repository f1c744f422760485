"""The run configuration: one YAML file with every knob, as frozen attrs classes.

Sections: ``run``, ``model``, ``data``, ``training``, ``distributed``, one per plugin family
(``sampler``, ``comm_hook``, ``checkpoint``, ``launch``), each naming a plugin and its options,
and ``plugins``, the sections plugins declare of their own.
Overrides from the command line use dotted key paths: ``-o training.lr=3e-4``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import attrs
import yaml

from ..checkpoint._best import keep_best
from ..engine._schedule import Rule
from ._errors import ConfigError, UsageError, did_you_mean, one_of
from ._stages import KEPT_WEIGHTS, Ref, merged, option_refs, picked, run_key
from ._structure import above, at_least, at_most, structure
from ._user_code import resolve_spec

F = TypeVar("F", bound="FactoryConfig")
T = TypeVar("T")


def folder_name(_instance: object, _attribute: attrs.Attribute[str], value: str) -> None:
    """Validator: ``value`` names one folder inside another (``run.name`` in
    ``run.output_dir``): not empty, ``.`` or ``..``, and no path separator (``/``, ``\\``)
    or NUL, so that it cannot name a place outside the folder it is joined to."""
    if value in ("", ".", "..") or any(c in value for c in "/\\\0"):
        raise ValueError(
            "a run's name is one folder's name inside run.output_dir: not empty, '.' or '..', "
            "and without '/', '\\' or NUL (e.g. 'pde-1')"
        )


@attrs.frozen(kw_only=True)
class RunConfig:
    """Naming, seeding and reporting of the run."""

    name: str = attrs.field(default="run", validator=folder_name)
    """The run's name, one folder's name (no ``/``, ``\\``, not ``.`` or ``..``); its files go
    to ``output_dir/name``."""
    seed: int = 0
    """Seeds model initialisation and data order on every rank."""
    output_dir: str = "runs"
    """Where runs keep their files (checkpoints, logs), relative to the working directory."""
    log_every: int = attrs.field(default=10, validator=at_least(1))
    """Report aggregated metrics every this many optimizer steps."""
    profile_steps: int | None = attrs.field(default=None, validator=at_least(1))
    """Trace this many steps after warm-up with ``torch.profiler``, per rank, then measure
    the communication profile; both go to the run's ``profile/`` folder
    (``ups train --profile STEPS``)."""
    straggler_threshold: float | None = attrs.field(default=0.2, validator=above(0))
    """Each report names the straggler: the rank whose time per step outside communication
    (waiting for data, forward, optimizer) exceeds the ranks' median by more than this
    fraction of it at two reports in a row (a ``straggler`` warning, a ``phases`` line in
    ``metrics.jsonl``, rows in ``ups report``); ``null``: steps not timed."""


@attrs.frozen(kw_only=True)
class FactoryConfig:
    """User code that builds something: ``factory`` is called with ``options`` as keywords."""

    factory: str
    """``package.module:callable`` or ``path/to/file.py:callable`` (relative to the config)."""
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class InitFrom:
    """A warm start: weights the model starts from, loaded once it is built, before the first
    step; only the weights (not the optimizer, nor where the run stood). A resumed run does
    not load them again: its checkpoint holds the weights it trained since
    (:mod:`ups.core.engine._model`)."""

    path: str | None = None
    """A run folder (its newest checkpoint, read through the checkpoint backend its
    ``config.yaml`` names), a checkpoint folder (``checkpoints/step-<N>``), or a file holding a
    ``state_dict`` (``ups export``'s); relative to the config's folder."""
    stage: str | None = None
    """Instead of ``path``: an earlier stage of this run (``stages``), by name; its final
    weights (``weights: latest``), its EMA's (``weights: ema``) or its best checkpoint's
    (``weights: best``, a stage with ``checkpoint.options.keep_best``)."""
    strict: bool = True
    """``false``: load the parameters and buffers found on both sides, and log the model's
    missing and the file's unexpected names in one line each; shapes that differ are refused
    either way."""
    weights: Literal["latest", "best", "ema"] = "latest"
    """Which weights of a run folder (or checkpoint folder): ``latest`` (its newest
    checkpoint's), ``ema`` (that checkpoint's average of the weights, a run with
    ``training.ema``), ``best`` (the checkpoint its ``best`` pointer names, a run with
    ``checkpoint.options.keep_best``)."""

    def __attrs_post_init__(self) -> None:
        if (self.path is None) == (self.stage is None):
            raise ValueError(
                "give one of path (weights saved somewhere) and stage (an earlier stage's)"
            )


@attrs.frozen(kw_only=True)
class ModelConfig(FactoryConfig):
    """The model: ``factory(**options)`` returns a ``torch.nn.Module``."""

    init_from: InitFrom | None = None
    """Weights to start from (a warm start); ``null``: the factory's own."""


@attrs.frozen(kw_only=True)
class LoaderConfig:
    """How batches are read: ``torch.utils.data.DataLoader``'s options. The sampler's state
    and data-side randomness stay exact with workers (:mod:`ups.core.engine._loader`)."""

    num_workers: int = attrs.field(default=0, validator=at_least(0))
    """Worker processes per rank reading and collating batches; ``0``: in the training process."""
    pin_memory: bool | None = None
    """Collate into pinned memory, for asynchronous copies to the GPU; ``null``: on with CUDA."""
    persistent_workers: bool = False
    """Keep the training loader's workers between epochs (needs ``num_workers > 0``); the
    evaluation's are kept between evaluations whatever this says."""
    prefetch_factor: int | None = attrs.field(default=None, validator=at_least(1))
    """Batches each worker reads ahead; ``null``: torch's default, 2 (needs ``num_workers > 0``)."""
    collate: str | None = None
    """``package.module:callable`` or ``file.py:callable`` making a batch of a list of samples;
    ``null``: torch's ``default_collate`` (tuples, dicts, namedtuples of tensors)."""
    multiprocessing_context: Literal["fork", "spawn", "forkserver"] | None = None
    """How workers start; ``null``: the platform's default."""
    reseed: tuple[Literal["torch", "python", "numpy"], ...] = ("torch",)
    """The global generators seeded before each sample is read, from ``(run.seed, epoch, the
    sample's place)``, so that a random transform drawing from them draws the same numbers
    whatever the workers and ranks: torch's CPU generator (about 1.2 µs a sample), Python's
    ``random`` (about 4 µs) and NumPy's legacy global generator (about 2 µs, and 70 µs a batch
    to compare and keep its state), once a read of the dataset drew from one (nothing before:
    :class:`~ups.core.engine._loader.SeededData`); ``[]``: none."""


@attrs.frozen(kw_only=True)
class DataConfig(FactoryConfig):
    """The training data: ``factory(**options)`` returns a map-style dataset; its items, as
    ``data.loader.collate`` makes batches of them, are what the step takes (by default
    ``(inputs, targets)`` or ``(inputs, targets, task_id)``)."""

    tasks: tuple[str, ...] = ()
    """Names of the tasks of multi-task data, in the order of their task ids."""
    loader: LoaderConfig = attrs.field(factory=LoaderConfig)
    """How batches are read (workers, pinned memory, collate); evaluation reads alike."""


@attrs.frozen(kw_only=True)
class StepConfig:
    """The training step (:class:`ups.core.Step`): how a batch becomes outputs, a loss, task
    ids and metrics, in training and evaluation."""

    factory: str = "ups.core:Step"
    """``file.py:callable`` or ``package.module:callable`` returning a :class:`ups.core.Step`;
    the default, the built-in step, takes ``training.loss`` and ``metrics.factory``."""
    options: dict[str, Any] = attrs.field(factory=dict)
    """Keyword arguments of ``factory``; for the built-in step: ``inputs``, ``target``,
    ``task`` (indices or keys of the batch, or lists of them, paths into nested batches:
    ``{inputs: [u0, params], target: [labels, y]}``)."""


@attrs.frozen(kw_only=True)
class PluginChoice:
    """A plugin section: the plugin's ``name`` and its ``options``."""

    name: str
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class EvalSamplerChoice(PluginChoice):
    name: str = "shard"
    """``shard``: rank ``r`` takes samples ``r, r + W, ...``, each exactly once."""


@attrs.frozen(kw_only=True)
class EvalConfig(FactoryConfig):
    """The evaluation data: ``factory(**options)`` returns a map-style dataset like the training
    data's. Evaluation is exact: every sample is counted once over all ranks, none padded."""

    every_steps: int | None = attrs.field(default=None, validator=at_least(1))
    """Evaluate every this many optimizer steps (and always at the end); ``null``: at the end."""
    batch_size: int | None = attrs.field(default=None, validator=at_least(1))
    """Samples per rank per evaluation batch; ``null``: ``training.batch_size``."""
    sampler: EvalSamplerChoice = attrs.field(factory=EvalSamplerChoice)
    """The evaluation sampler: one whose plugin declares ``exact=True``."""


@attrs.frozen(kw_only=True)
class MetricsConfig(FactoryConfig):
    """User metrics, computed on every micro-batch without gradients, in training and
    evaluation: a step's :meth:`~ups.core.Step.metrics`, or for the built-in step
    ``factory(**options)``, a ``fn(outputs, targets)``. Either returns a mapping of names to
    numbers (floats or 0-d tensors) or to per-sample tensors (averaged, and per task). Every
    rank must return the same names."""

    factory: str | None = None  # type: ignore[assignment]
    """``fn(outputs, targets)``'s maker, for the built-in step; ``null``: the step's own
    ``metrics`` (a step of ``step.factory`` computes its metrics itself)."""

    reduce: dict[str, Literal["mean", "sum", "max"]] = attrs.field(factory=dict)
    """How each metric is aggregated over the batches of a report and over all ranks:
    ``mean`` (weighted by batch size; the default for names not listed), ``sum`` or ``max``."""


def open_unit(_instance: object, _attribute: attrs.Attribute[float], value: float) -> None:
    """Validator: ``value`` is in the open interval ``(0, 1)``."""
    if not 0 < value < 1:
        raise ValueError("must be in (0, 1), e.g. 0.999")


@attrs.frozen(kw_only=True)
class EMAConfig:
    """An exponential moving average of the weights (:class:`ups.core.EMA`), kept in fp32 on
    every rank (the same on each, without communication) and saved in checkpoints."""

    decay: float = attrs.field(default=0.999, validator=open_unit)
    """The weight of the old average at each update, in ``(0, 1)``."""
    every_steps: int = attrs.field(default=1, validator=at_least(1))
    """Update the average every this many optimizer steps after ``start_step``."""
    start_step: int = attrs.field(default=0, validator=at_least(0))
    """Until this optimizer step the average is a copy of the weights; it averages after it."""
    warmup: bool = False
    """The decay of the ``n``-th update is ``min(decay, (1 + n) / (10 + n))``."""
    evaluate: Literal["both", "ema", "live"] = "both"
    """Which weights evaluations measure: ``both`` (the EMA's metrics beside the live ones',
    named ``loss_ema``, ``loss_ema/<task>``, ``<metric>_ema``), ``ema`` (the EMA's only, under
    the plain names: ``loss``, ...) or ``live``."""


@attrs.frozen(kw_only=True)
class GuardConfig:
    """What every rank does, together, when an optimizer step goes bad: its global gradient
    norm (after the gradients are averaged over the ranks, the same number on every rank) is
    not finite, or spikes over ``spike`` times its running average."""

    action: Literal["skip", "rollback", "stop"] = "skip"
    """``skip``: every rank drops the step (no update, the scheduler and the schedule as if it
    did not happen), counted as ``guard_skipped``; ``rollback``: every rank restores its
    snapshot (``snapshot_every``) and replays from there, passing over the offending step's
    batches (quarantined in ``guard.jsonl``), counted as ``guard_rollbacks``; ``stop``: every
    rank stops with one line naming the step, the ranks whose loss was not finite, the tasks
    and the batches."""
    spike: float | None = attrs.field(default=None, validator=above(1))
    """A norm over this many times the running average of the accepted steps' norms is a
    spike (after ``warmup_steps`` of them); ``null``: only a norm that is not finite is."""
    warmup_steps: int = attrs.field(default=20, validator=at_least(1))
    """Accepted steps whose norms the running average takes before spikes are looked for."""
    max_skips: int = attrs.field(default=3, validator=at_least(0))
    """With ``skip``: stop as ``stop`` does once more than this many steps were skipped within
    the last ``window`` steps attempted (``0``: the first bad step stops)."""
    window: int = attrs.field(default=100, validator=at_least(1))
    """The steps attempted (taken or skipped) over which ``max_skips`` and ``max_rollbacks``
    count."""
    snapshot_every: int = attrs.field(default=50, validator=at_least(1))
    """With ``rollback``: each rank copies its training state in memory every this many
    optimizer steps (and when an epoch is entered with none held)."""
    max_rollbacks: int = attrs.field(default=3, validator=at_least(0))
    """With ``rollback``: stop as ``stop`` does once more than this many rollbacks fall within
    the last ``window`` steps attempted (``0``: the first bad step stops)."""
    lr_factor: float = attrs.field(default=1.0, validator=above(0))
    """Multiply the LR by this for the ``lr_steps`` optimizer steps after each quarantined step
    passed over (by a rollback's replay, or from ``quarantine``), on top of the schedule's
    multiplier."""
    lr_steps: int = attrs.field(default=100, validator=at_least(1))
    """How many optimizer steps ``lr_factor`` lasts."""
    quarantine: str | None = None
    """The ``guard.jsonl`` of an earlier run (a path): every rank passes over the global steps
    it names, each as a whole (its batches on every rank), every other batch keeping its seed
    and place."""


@attrs.frozen(kw_only=True)
class TrainingConfig:
    """The optimisation."""

    epochs: int = attrs.field(default=1, validator=at_least(1))
    batch_size: int = attrs.field(default=32, validator=at_least(1))
    """Samples per rank per micro-batch."""
    accumulation_steps: int = attrs.field(default=1, validator=at_least(1))
    """Micro-batches per optimizer step; gradients are synchronised on the last one only."""
    lr: float = attrs.field(default=1e-3, validator=above(0))
    optimizer: str = "adamw"
    """A ``torch.optim`` class by name (any case: ``adamw``, ``SGD``) or ``package.module:Class``;
    ``fused`` is turned on where the optimizer has it and the model is on CUDA."""
    optimizer_options: dict[str, Any] = attrs.field(factory=dict)
    """Further keyword arguments of the optimizer (``betas``, ``momentum``, ...)."""
    weight_decay: float = attrs.field(default=0.0, validator=at_least(0))
    scheduler: str | None = None
    """A ``torch.optim.lr_scheduler`` class by name (``CosineAnnealingLR``) or import path;
    stepped once per optimizer step."""
    scheduler_options: dict[str, Any] = attrs.field(factory=dict)
    loss: Literal["mse", "l1", "cross_entropy"] = "mse"
    grad_clip_norm: float | None = attrs.field(default=None, validator=above(0))
    """Clip the global gradient norm (over all parameters, the same on every rank) to this."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """``bf16``: autocast to bfloat16 (CPU and CUDA); ``fp16``: autocast to float16 with a
    gradient scaler (CUDA only)."""
    compile: bool = False
    """``torch.compile`` the model before wrapping it in DDP."""
    max_steps: int | None = attrs.field(default=None, validator=at_least(1))
    """Stop after this many optimizer steps, even mid-epoch."""
    skip_oom: bool | Literal["auto"] = "auto"
    """Agree every step, before the synchronising backward, on whether every rank got there
    (one all-reduce of a flag): a rank out of memory makes every rank skip the step, any other
    error stops every rank naming it. ``auto``: on CUDA and on one process; off for several
    CPU processes, where memory errors are not recoverable and the flag costs most."""
    max_oom_skips: int = attrs.field(default=3, validator=at_least(0))
    """With ``skip_oom``, stop with an error after this many skipped steps in a row (``0``:
    the first out-of-memory error stops the run)."""
    peak_flops: float | None = attrs.field(default=None, validator=above(0))
    """Peak FLOP/s of one device, for the ``mfu`` metric (with a model that counts its FLOPs)."""
    ema: EMAConfig | None = None
    """An exponential moving average of the weights; ``null``: none."""
    guard: GuardConfig | None = None
    """What every rank does when a step's gradient norm is not finite or spikes; ``null``:
    nothing (a loss that is not finite stops the run at the next report or checkpoint)."""


@attrs.frozen(kw_only=True)
class DistributedConfig:
    """The process group and the DDP wrapper."""

    enabled: bool | Literal["auto"] = "auto"
    """``auto``: distributed when launched as several processes, falling back to one process
    with a warning if the process group cannot start; ``true``: fail instead; ``false``: never."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``auto`` is nccl when every rank has a CUDA device, else gloo."""
    nproc: int = attrs.field(default=1, validator=at_least(1))
    """Processes to start on this machine (``ups train --nproc`` overrides it)."""
    timeout_s: float = attrs.field(default=300.0, validator=[above(0), at_most(1e9)])
    """Seconds a rank may spend in one training step before the run stops, naming the ranks
    that stopped answering (:mod:`ups.core.dist._watchdog`); collectives time out a grace later.
    At most ``1e9`` (31 years: torch's clocks overflow past about ``1e13``)."""
    max_restarts: int = attrs.field(default=0, validator=at_least(0))
    """Times the elastic agent of ``ups train --nproc`` restarts every rank after one fails
    (``ups train --max-restarts``); a restarted run resumes from its newest checkpoint."""
    desync_check_every: int | None = attrs.field(default=None, validator=at_least(1))
    """Every this many optimizer steps, check that every rank holds the same parameters (one
    all-gather of a few numbers), naming a rank that diverged; ``null``: at the start only."""
    bucket_cap_mb: float = attrs.field(default=25.0, validator=[above(0), at_most(1e12)])
    """DDP's gradient bucket size; at most ``1e12`` (its bytes fit in 64 bits)."""
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to SyncBatchNorm (statistics over all ranks)."""


@attrs.frozen(kw_only=True)
class SamplerChoice(PluginChoice):
    name: str = "torch"


@attrs.frozen(kw_only=True)
class CommHookChoice(PluginChoice):
    name: str = "none"
    """``none`` keeps DDP's own allreduce."""


@attrs.frozen(kw_only=True)
class StrategyChoice(PluginChoice):
    name: str = "ddp"
    """How the model is spread over the ranks: ``ddp`` holds it whole on every rank;
    ups-fsdp's ``zero`` shards the optimizer's state, ``fsdp`` the parameters too."""


@attrs.frozen(kw_only=True)
class CheckpointChoice(PluginChoice):
    name: str = "simple"
    every_steps: int | None = attrs.field(default=None, validator=at_least(1))
    """Save every this many optimizer steps (and always at the end); ``null``: at the end only."""
    resume: Literal["none", "latest"] = "none"
    """``latest``: continue from the newest checkpoint in the run's folder, if there is one,
    where it stopped (mid-epoch included); ``none``: always start afresh."""
    allow_changed: tuple[Literal["seed", "accumulation_steps", "dataset"], ...] = ()
    """What may differ from the run a resume continues: ``seed``, ``accumulation_steps``
    (the configured one), ``dataset`` (its size, and its tasks' sizes); anything else listed
    here that changed refuses the resume (``ups train --allow-changed KEY``)."""
    preempt_signals: tuple[Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"], ...] = (
        "SIGTERM",
        "SIGUSR1",
    )
    """Signals that make every rank save at the next step boundary and stop (``ups train`` exits
    with status 75, preempted and resumable), to resume later; ``[]``: none (a signal then acts
    as it would without ups)."""


@attrs.frozen(kw_only=True)
class LaunchChoice(PluginChoice):
    name: str | None = None  # type: ignore[assignment]
    """The launcher ``ups launch`` uses; ``null``: none chosen (``ups train`` needs none)."""


def stage_name(_instance: object, _attribute: attrs.Attribute[str], value: str) -> None:
    """Validator: ``value`` names a stage: letters, digits, ``_``, ``-`` and ``.``, not only
    dots (it is the name of the folder its weights are kept in)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", value) or set(value) == {"."}:
        raise ValueError("a stage's name is letters, digits, '_', '-' and '.' (e.g. 'operator')")


@attrs.frozen(kw_only=True)
class Stage:
    """One stage of a run of several (``stages``): a training of the base config with
    ``overrides`` applied, after the stage before it, in the same run folder and process
    group, its steps numbered on from the stage before's (:mod:`ups.core.config._stages`)."""

    name: str = attrs.field(validator=stage_name)
    """The stage's name: later stages name it (``model.init_from.stage``, ``{stage: NAME}`` in
    ``model.options`` or ``step.options``); its weights are kept in ``stages/NAME/``."""
    max_steps: int | None = attrs.field(default=None, validator=at_least(1))
    """The stage's ``training.max_steps`` (its own steps, counted from its start)."""
    epochs: int | None = attrs.field(default=None, validator=at_least(1))
    """The stage's ``training.epochs``."""
    overrides: dict[str, Any] = attrs.field(factory=dict)
    """Keys of the base config the stage sets, nested as in the config (``training: {lr:
    1e-4}``): sections are merged key by key, any other value (``options`` mappings and lists
    included) replaced whole."""


@attrs.frozen(kw_only=True)
class Config:
    """A whole run's configuration."""

    model: ModelConfig
    data: DataConfig
    eval: EvalConfig | None = None
    """Evaluation data and how often to evaluate; ``null``: no evaluation."""
    metrics: MetricsConfig | None = None
    """User metrics reported with the loss; ``null``: the loss and the step's own metrics."""
    step: StepConfig = attrs.field(factory=StepConfig)
    """How a batch trains the model (forward, loss, task ids, metrics)."""
    run: RunConfig = attrs.field(factory=RunConfig)
    training: TrainingConfig = attrs.field(factory=TrainingConfig)
    distributed: DistributedConfig = attrs.field(factory=DistributedConfig)
    sampler: SamplerChoice = attrs.field(factory=SamplerChoice)
    comm_hook: CommHookChoice = attrs.field(factory=CommHookChoice)
    strategy: StrategyChoice = attrs.field(factory=StrategyChoice)
    checkpoint: CheckpointChoice = attrs.field(factory=CheckpointChoice)
    launch: LaunchChoice = attrs.field(factory=LaunchChoice)
    schedule: tuple[Rule, ...] = ()
    """Training operations decided on rank 0 and applied on every rank (:mod:`ups.core.engine._schedule`)."""
    plugins: dict[str, Any] = attrs.field(factory=dict)
    """The config sections plugins declare (``ups_config_sections``), by name: each a mapping
    of the keys its plugin takes (``plugins: {mlflow: {experiment: pde}}``)."""
    stages: tuple[Stage, ...] = ()
    """Trainings run one after another in this run (:class:`Stage`); ``[]``: one training,
    of this config."""

    @property
    def run_dir(self) -> Path:
        """The run's own folder: ``run.output_dir/run.name``."""
        return Path(self.run.output_dir) / self.run.name

    def section(self, cls: type[T], name: str) -> T:
        """The ``plugins.NAME`` section built into its plugin's options class ``cls``; a section
        left out is built from ``cls``'s defaults.

        :raises ConfigError: naming the key path of a key or value ``cls`` refuses.
        """
        return structure(cls, self.plugins.get(name), f"plugins.{name}")

    def digest(self) -> str:
        """A short hash of the resolved configuration; equal configs give equal digests."""
        text = json.dumps(attrs.asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one mapping, which PyYAML would otherwise read as the last value."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading numbers as YAML 1.2 does (``3e-4`` is a float, not a
    string), and refusing a key given twice in one mapping (YAML requires unique keys)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<": merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key: the constructor names it
                continue
            if first is not None:
                raise DuplicateKeyError(
                    f"the key {key!r} is given twice in one mapping, on lines {first} and {line}; "
                    "keep one"
                )
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def read_yaml(text: str) -> Any:
    """Parse YAML safely (no objects), with YAML 1.2's reading of exponent numbers."""
    return yaml.load(text, Loader=_Loader)


def parse_overrides(overrides: Iterable[str]) -> list[tuple[list[str], Any]]:
    """Parse ``key.path=value`` strings; values are read as YAML scalars (``3e-4``, ``true``)."""
    parsed = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise UsageError(f"override {item!r} is not of the form key.path=value")
        try:
            value = read_yaml(text)
        except DuplicateKeyError as error:
            raise UsageError(f"override {item!r}: {error}") from None
        except yaml.YAMLError:
            value = text
        parsed.append((key.split("."), value))
    return parsed


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with every ``key.path=value`` override set."""
    result = copy.deepcopy(data)
    for keys, value in parse_overrides(overrides):
        node = result
        for depth, part in enumerate(keys[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    ".".join(keys[: depth + 1]), "is not a section; cannot override in it"
                )
            node = child
        node[keys[-1]] = value
    return result


def read_config(path: str | Path, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """Read a YAML config file and apply ``overrides``; check nothing more (for a command that
    takes a section of its own out first, as ``ups sweep`` does its ``sweep``).

    :raises UsageError: a missing or unreadable file, not YAML, not a mapping, a bad override.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise UsageError(f"cannot read config file {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise UsageError(
            f"{path}: not a YAML text file: byte {error.start} is not UTF-8 ({error.reason})"
        ) from None
    try:
        data = read_yaml(text)
    except yaml.YAMLError as error:
        raise UsageError(f"{path}: not valid YAML: {' '.join(str(error).split())}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"{path}: the top level must be a mapping of sections")
    try:
        return apply_overrides(data, overrides)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error.path}", error.problem) from None


def load_config(
    path: str | Path, overrides: Iterable[str] = (), *, sections: Mapping[str, type] | None = None
) -> Config:
    """Read, override and check a YAML config file.

    Relative ``file.py:callable`` paths (``model.factory``, ``data.factory``, ``step.factory``,
    ``data.loader.collate``, ...) are resolved against the file's folder. Plugin names and options are checked later, against the plugins
    installed (:func:`ups.core.config._validate.validate`).

    :param sections: top-level sections that are no part of the run's config, by name, each
        checked against its attrs class and left out (``ups validate``: the sections plugin
        commands read, such as ``sweep``).
    :raises UsageError: a missing or unreadable file, or a :class:`ConfigError` naming the key.
    """
    path = Path(path)
    data = read_config(path, overrides)
    try:
        for name, cls in (sections or {}).items():
            if name in data:
                structure(cls, data.pop(name), name)
        config = structure(Config, data)
        return _resolved(config, path.resolve().parent)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error.path}", error.problem) from None


def config_from_mapping(data: Mapping[str, Any], base_dir: Path | None = None) -> Config:
    """Build a config from a mapping (for the Python API); file paths resolve against ``base_dir``."""
    return _resolved(structure(Config, dict(data)), (base_dir or Path.cwd()).resolve())


def _resolved(config: Config, base: Path) -> Config:
    """``config`` with its file paths, and its stages', resolved against ``base`` (made
    absolute), each stage's config checked.

    :raises ConfigError: at ``stages[i].overrides.KEY`` for an override the config refuses
        (an unknown key, with what is allowed) or a key of the whole run, at
        ``stages[i].KEY`` for a stage that names no earlier stage.
    """
    config = _resolve_paths(config, base)
    init_from = config.model.init_from
    if not config.stages and init_from is not None and init_from.stage is not None:
        raise ConfigError(
            "model.init_from.stage", "names an earlier stage of stages, and this run has none"
        )
    names: dict[str, int] = {}
    stages = []
    for index, stage in enumerate(config.stages):
        if stage.name in names:
            raise ConfigError(
                f"stages[{index}].name",
                f"{stage.name!r} is the name of stages[{names[stage.name]}] too; name each "
                "stage once",
            )
        if (key := run_key(stage.overrides)) is not None:
            raise ConfigError(
                f"stages[{index}].overrides.{key}",
                "is the whole run's, the same in every stage: set it in the base config",
            )
        staged = _resolve_paths(stage_config(config, index), base)
        _check_refs(config, index, staged, names)
        names[stage.name] = index
        stages.append(attrs.evolve(stage, overrides=picked(attrs.asdict(staged), stage.overrides)))
    return attrs.evolve(config, stages=tuple(stages))


def stage_config(config: Config, index: int) -> Config:
    """The config of ``config``'s stage ``index``: the base config (without ``stages``) with
    the stage's ``overrides`` merged in (:func:`~ups.core.config._stages.merged`), and its
    ``max_steps`` and ``epochs`` set.

    :raises ConfigError: at ``stages[index].overrides.KEY``, for a value the config refuses.
    """
    stage = config.stages[index]
    data = merged(Config, attrs.asdict(attrs.evolve(config, stages=())), stage.overrides)
    training = dict(data["training"])
    for key in ("max_steps", "epochs"):
        if getattr(stage, key) is not None:
            training[key] = getattr(stage, key)
    data["training"] = training
    try:
        return structure(Config, data)
    except ConfigError as error:
        raise ConfigError(f"stages[{index}].overrides.{error.path}", error.problem) from None


def stage_refs(config: Config) -> list[Ref]:
    """The options of ``config``'s model and step factories that name an earlier stage."""
    return [
        *option_refs("model", config.model.options),
        *option_refs("step", config.step.options),
    ]


def _check_refs(config: Config, index: int, staged: Config, earlier: Mapping[str, int]) -> None:
    """Check that what stage ``index`` (its config ``staged``) names of other stages are
    ``earlier`` ones, and an EMA one that keeps it.

    :raises ConfigError: at ``stages[index].KEY``, naming the earlier stages.
    """
    named = [
        (f"{ref.section}.options.{ref.option}", ref.stage, ref.weights)
        for ref in stage_refs(staged)
    ]
    init_from = staged.model.init_from
    if init_from is not None and init_from.stage is not None:
        named.append(("model.init_from.stage", init_from.stage, init_from.weights))
    for key, name, weights in named:
        where = f"stages[{index}].{key}"
        if name not in earlier:
            allowed = one_of(earlier) if earlier else "none (it is the first stage)"
            raise ConfigError(
                where,
                f"{name!r} is no earlier stage; allowed: {allowed}{did_you_mean(name, earlier)}",
            )
        if weights not in KEPT_WEIGHTS:
            raise ConfigError(where, f"weights {weights!r}: a stage keeps {one_of(KEPT_WEIGHTS)}")
        earlier_config = stage_config(config, earlier[name])
        if weights == "ema" and earlier_config.training.ema is None:
            raise ConfigError(
                where, f"weights ema: stage {name!r} keeps no EMA (it has no training.ema)"
            )
        if weights == "best" and keep_best(earlier_config.checkpoint.options) is None:
            raise ConfigError(
                where,
                f"weights best: stage {name!r} keeps no best checkpoint (it has no "
                "checkpoint.options.keep_best)",
            )


def _resolve_paths(config: Config, base: Path) -> Config:
    """``config`` with its file paths absolute, relative ones taken from ``base``."""
    return _map_paths(
        config, lambda spec: resolve_spec(spec, base), lambda path: str((base / path).resolve())
    )


def relative_paths(config: Config, folder: Path) -> Config:
    """``config`` (its file paths absolute) with its file paths relative to ``folder``: what
    a run folder's ``config.yaml`` keeps, so that the folder moved or copied together with the
    project it names still loads (:func:`load_config` reads them relative to the file)."""
    here = folder.resolve()

    def relative(path: str) -> str:
        return os.path.relpath(path, here) if Path(path).is_absolute() else path

    def spec(text: str) -> str:
        target, sep, attr = text.rpartition(":")
        return f"{relative(target)}:{attr}" if sep and target.endswith(".py") else text

    return _map_paths(config, spec, relative)


def _map_paths(config: Config, spec: Callable[[str], str], path: Callable[[str], str]) -> Config:
    """``config`` with ``spec`` applied to every ``file.py:callable`` key and ``path`` to
    every file path (``model.init_from.path``)."""

    def mapped(section: F) -> F:
        return attrs.evolve(section, factory=section.factory and spec(section.factory))

    data = mapped(config.data)
    if data.loader.collate is not None:
        data = attrs.evolve(
            data, loader=attrs.evolve(data.loader, collate=spec(data.loader.collate))
        )
    model = mapped(config.model)
    if model.init_from is not None and model.init_from.path is not None:
        init_from = attrs.evolve(model.init_from, path=path(model.init_from.path))
        model = attrs.evolve(model, init_from=init_from)
    return attrs.evolve(
        config,
        model=model,
        data=data,
        eval=config.eval and mapped(config.eval),
        metrics=config.metrics and mapped(config.metrics),
        step=attrs.evolve(config.step, factory=spec(config.step.factory)),
    )
