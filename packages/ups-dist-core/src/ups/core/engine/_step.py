"""The training step: how a batch becomes outputs, a loss, task ids and metrics.

A :class:`Step` is the one thing the engine asks of a user's model and data, after Composer's
``ComposerModel.forward(batch)`` + ``loss(outputs, batch)`` and Lightning's ``training_step``,
but kept apart from the model: the model stays a plain ``nn.Module`` that DDP wraps, and the
step says how to call it. The engine does the rest (devices, DDP, accumulation, AMP, clipping,
metrics over ranks, evaluation under ``no_grad`` with the same step).

The built-in step is the default: ``(inputs, targets[, task_ids])`` tuples and a loss by name
(``training.loss``). Its class attributes say where things are, so a dict batch needs no code::

    step:
      options: {inputs: [u0, params], target: u_t, task: task}

A place is an index or a key, or a list of them: a path into nested batches
(``target: [labels, y]`` is ``batch["labels"]["y"]``; ``inputs: {x: [inputs, field]}``).

A model with its own loss subclasses :class:`Step` and overrides :meth:`Step.forward` and
:meth:`Step.loss` (``step: {factory: model.py:MyStep}``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..config._config import Config
from ..config._errors import ConfigError, UsageError
from ..config._user_code import load_object

if TYPE_CHECKING:  # building a step (``ups validate``) imports no torch; running one does
    import torch
    from torch import nn

Key = int | str
"""An index, or a key or attribute name."""
Where = Key | list[Key] | tuple[Key, ...] | Callable[[Any], Any]
"""Where something is in a batch: an index, a key or attribute name, a path of them into
nested batches (``["labels", "y"]``: ``batch["labels"]["y"]``), or a function of the batch."""

Criterion = Callable[[Any, Any], "torch.Tensor"]
"""``criterion(outputs, targets)``: an unreduced loss (one value per sample, or per element)."""


def _unreduced(loss: str, name: str) -> Criterion:
    """The loss ``torch.nn.functional.<name>`` (``training.loss: <loss>``) with
    ``reduction="none"``, of tensors only.

    :raises StepError: naming what is not a tensor (the model's outputs or the target).
    """

    def criterion(outputs: Any, targets: Any) -> torch.Tensor:
        import torch
        from torch.nn import functional

        if not (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
            raise _not_tensors(loss, outputs, targets)
        return getattr(functional, name)(outputs, targets, reduction="none")  # type: ignore[no-any-return]

    return criterion


def _not_tensors(loss: str, outputs: Any, targets: Any) -> StepError:
    """The error for a loss by name given ``outputs`` or ``targets`` that are not tensors."""
    import torch

    own = "or compute the loss in a Step of your own (override loss; step.factory)"
    if not isinstance(outputs, torch.Tensor):
        return StepError(
            f"training.loss: {loss!r} takes tensors, and the model (model.factory) returned "
            f"{_a(outputs)}; return a tensor from its forward, {own}"
        )
    return StepError(
        f"training.loss: {loss!r} takes tensors, and the batch's target (step.target) is "
        f"{_a(targets)}; point step.options.target at a tensor (a list of keys is a path into "
        f"nested batches: [labels, y]), {own}"
    )


def _a(value: Any) -> str:
    """``a list``, ``an Output``: what ``value`` is, for a message."""
    name = type(value).__qualname__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


FUNCTIONS = {"mse": "mse_loss", "l1": "l1_loss", "cross_entropy": "cross_entropy"}
"""The losses ``training.loss`` names, and their functions in ``torch.nn.functional``."""

CRITERIA: dict[str, Criterion] = {name: _unreduced(name, fn) for name, fn in FUNCTIONS.items()}
"""The losses ``training.loss`` names, unreduced."""

MEANS = ("mse", "l1")
"""The losses whose mean over a batch (``torch.nn.functional``'s default reduction) is the mean
of their per-sample losses, when outputs and targets have one shape: every sample averages over
as many elements (not ``cross_entropy``, whose mean leaves out ignored targets)."""


def batch_mean(step: Step) -> Callable[[Any, Any], torch.Tensor | None] | None:
    """For the built-in step's loss by name (one of :data:`MEANS`): ``mean(outputs, batch)``,
    the batch's mean loss in one operation, or ``None`` where outputs and target differ in
    shape (then only :meth:`Step.loss` says what the loss is). ``None`` for other steps."""
    criterion = _raw(step, "criterion")
    if type(step).loss is not Step.loss or criterion not in MEANS:
        return None
    import torch
    from torch.nn import functional

    where, tensor = _raw(step, "target"), torch.Tensor
    fn = getattr(functional, FUNCTIONS[criterion])

    def mean(outputs: Any, batch: Any) -> torch.Tensor | None:
        target = pick(batch, where, "step.target")
        if not (
            isinstance(outputs, tensor)
            and isinstance(target, tensor)
            and outputs.shape == target.shape
            and outputs.dim()
            and outputs.is_floating_point()
        ):
            return None
        return fn(outputs, target).float()  # type: ignore[no-any-return]

    return mean


_UNSET: Any = object()
"""``task``'s default in the constructor (``None`` there means: no tasks)."""


class StepError(UsageError):
    """A step returned what the engine cannot use, or looked for what the batch lacks."""


class Step:
    """How one batch trains the model; subclass it and override what your model needs.

    Every method gets the batch as the loader's ``collate`` made it, on the model's device.
    The defaults serve ``(inputs, targets[, task_ids])`` tuples and dicts alike, through the
    attributes below (set them on a subclass, or pass them to the constructor, or as
    ``step.options`` in the config).
    """

    inputs: Where | Sequence[Where] | Mapping[str, Where] = 0
    """Where the model's inputs are: one place (``model(x)``), a list of places (positional
    arguments: ``[[inputs, field]]`` is one, at a path), or a mapping of keyword to place
    (``model(z0=batch["u0"], ...)``)."""
    target: Where = 1
    """Where the target is, for :meth:`loss` and for the ``metrics`` section's function (a
    list is a path into nested batches)."""
    task: Where | None = 2
    """Where each sample's task id is (for ``loss/<task>`` and per-task metrics); ``None``:
    no tasks. The default, index 2, is optional: a 2-tuple batch has no task ids."""
    criterion: str | Criterion = "mse"
    """The loss of :meth:`loss`: ``mse``, ``l1``, ``cross_entropy`` or a function
    ``(outputs, targets) -> unreduced loss``."""
    metric_fn: Callable[[Any, Any], Mapping[str, Any]] | None = None
    """``fn(outputs, targets)`` for :meth:`metrics` (the config's ``metrics.factory``)."""

    def __init__(
        self,
        *,
        inputs: Where | Sequence[Where] | Mapping[str, Where] | None = None,
        target: Where | None = None,
        task: Any = _UNSET,
        criterion: str | Criterion | None = None,
        metric_fn: Callable[[Any, Any], Mapping[str, Any]] | None = None,
    ) -> None:
        if inputs is not None:
            self.inputs = inputs
        if target is not None:
            self.target = target
        if task is not _UNSET:
            self.task = task
        if criterion is not None:
            if not (callable(criterion) or (isinstance(criterion, str) and criterion in CRITERIA)):
                raise StepError(
                    f"step.criterion: {criterion!r} is not a loss; allowed: "
                    f"{', '.join(CRITERIA)}, or a function (outputs, targets) -> loss"
                )
            self.criterion = criterion
        if metric_fn is not None:
            self.metric_fn = metric_fn

    def forward(self, model: nn.Module, batch: Any) -> Any:
        """The model's outputs for ``batch``; by default ``model`` called with :attr:`inputs`."""
        where = _raw(self, "inputs")
        if isinstance(where, int | str):  # the usual: one index or key
            return model(pick(batch, where, "step.inputs"))
        if isinstance(where, Mapping):
            return model(**{name: pick(batch, w, "step.inputs") for name, w in where.items()})
        if isinstance(where, list | tuple):
            return model(*(pick(batch, w, "step.inputs") for w in where))
        return model(pick(batch, where, "step.inputs"))

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor | tuple[torch.Tensor, int]:
        """The loss: one value per sample (shape ``[batch size]``: accumulation, per-task
        losses and equivalence over ranks hold exactly), or a 0-d mean over the batch, or
        ``(mean, samples)`` when it averages over another number of samples (tokens, say).
        By default :attr:`criterion` against :attr:`target`, averaged per sample."""
        criterion = _raw(self, "criterion")
        fn = CRITERIA[criterion] if isinstance(criterion, str) else criterion
        unreduced = fn(outputs, pick(batch, _raw(self, "target"), "step.target")).float()
        if unreduced.numel() == len(unreduced):  # one value per sample already: no mean to take
            return unreduced.reshape(len(unreduced))
        return unreduced.reshape(len(unreduced), -1).mean(dim=1)

    def task_ids(self, batch: Any) -> torch.Tensor | None:
        """Each sample's task id (integers in ``data.tasks`` order), or ``None``."""
        where = _raw(self, "task")
        if where is None:
            return None
        if isinstance(where, int) and isinstance(batch, list | tuple) and where >= len(batch):
            return None
        import torch

        return torch.as_tensor(pick(batch, where, "step.task"))

    def metrics(self, outputs: Any, batch: Any) -> Mapping[str, Any]:
        """Metrics of the batch (called without gradients, in training and evaluation): a
        number or 0-d tensor per name (aggregated as ``metrics.reduce`` says), or a tensor of
        one value per sample (averaged over samples, overall and per task: ``name/<task>``).
        By default the config's ``metrics.factory`` function, if any."""
        fn = _raw(self, "metric_fn")
        if fn is None:
            return {}
        return fn(outputs, pick(batch, _raw(self, "target"), "step.target"))  # type: ignore[no-any-return]

    def batch_size(self, batch: Any) -> int:
        """Samples in ``batch``: by default the first dimension of its first tensor."""
        from ._batches import batch_size

        return batch_size(batch)


def has_metrics(step: Step) -> bool:
    """Whether ``step`` computes metrics: its own ``metrics``, or the built-in one's with a
    function (``metrics.factory``)."""
    return type(step).metrics is not Step.metrics or _raw(step, "metric_fn") is not None


def _raw(step: Step, name: str) -> Any:
    """``step``'s attribute ``name`` as set: a function set on the class is not bound to the
    step (``task = task_of`` calls ``task_of(batch)``). What ``inspect.getattr_static`` finds
    for a plain class, at a tenth of its cost (it is looked up several times a step)."""
    own = vars(step)
    if name in own:
        return own[name]
    for klass in type(step).__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    raise AttributeError(f"{type(step).__name__} has no attribute {name!r}")


_PATHS = (list, tuple)
"""A path's types, as a tuple: ``isinstance`` takes it faster than ``list | tuple`` (made
anew at each call), and :func:`pick` runs several times a step."""


def pick(batch: Any, where: Where, key: str) -> Any:
    """What ``where`` names in ``batch``: an index, a key, an attribute, what a path of them
    names in nested batches, or a function's result.

    :raises StepError: naming ``key`` and what the batch has instead.
    """
    if callable(where):
        return where(batch)
    if isinstance(where, int):
        if isinstance(batch, list | tuple) or (
            isinstance(batch, Sequence) and not isinstance(batch, str)
        ):
            if -len(batch) <= where < len(batch):
                return batch[where]
            raise StepError(f"{key}: index {where} is past the batch's {len(batch)} elements")
        raise StepError(f"{key}: index {where} of a {type(batch).__name__} batch; name a key")
    if isinstance(where, _PATHS):
        for depth, part in enumerate(where):
            batch = pick(batch, part, f"{key}[{depth}]")
        return batch
    if isinstance(batch, Mapping):
        if where in batch:
            return batch[where]
        keys = ", ".join(map(str, batch))
        raise StepError(f"{key}: the batch has no key {where!r}; its keys: {keys}")
    if hasattr(batch, where):
        return getattr(batch, where)
    raise StepError(f"{key}: a {type(batch).__name__} batch has no attribute or key {where!r}")


def build_model(config: Config) -> nn.Module:
    """Call ``model.factory(**model.options)``; check that it returns a module."""
    from torch import nn  # building a model imports torch, building a step does not

    model = load_object(config.model.factory, "model.factory")(**config.model.options)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "model.factory", f"returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def build_step(config: Config) -> Step:
    """Call ``step.factory(**step.options)``; the built-in step (or a subclass that keeps its
    constructor, loss and metrics) also takes ``training.loss`` and ``metrics.factory``'s
    function.

    :raises ConfigError: naming ``step.factory``, ``step.options`` or ``metrics.factory``.
    """
    factory = load_object(config.step.factory, "step.factory")
    options = dict(config.step.options)
    metrics = config.metrics.factory if config.metrics is not None else None
    # A Step (or a subclass keeping its constructor) whose loss and metrics are the built-in
    # ones takes training.loss and metrics.factory's function.
    cls: Any = factory if isinstance(factory, type) and issubclass(factory, Step) else None
    built_in = cls is not None and cls.__init__ is Step.__init__
    if built_in and cls.loss is Step.loss and cls.criterion is Step.criterion:
        options.setdefault("criterion", config.training.loss)
    if metrics is not None:
        if not built_in or cls.metrics is not Step.metrics:
            raise ConfigError(
                "metrics.factory",
                f"is for the built-in step's metrics; {config.step.factory} computes its "
                "metrics in its own metrics(outputs, batch) (metrics.reduce still applies)",
            )
        metric_fn = load_object(metrics, "metrics.factory")(
            **config.metrics.options  # type: ignore[union-attr]
        )
        if not callable(metric_fn):
            raise ConfigError(
                "metrics.factory", f"returned {_a(metric_fn)}, not a function fn(outputs, targets)"
            )
        options["metric_fn"] = metric_fn
    try:
        step = factory(**options)
    except TypeError as error:
        raise ConfigError("step.options", f"{config.step.factory}: {error}") from None
    if not isinstance(step, Step):
        raise ConfigError(
            "step.factory", f"returned {type(step).__name__}, not a ups.core.Step (subclass it)"
        )
    check_places(step)
    return step


_PATH = "a list of them is a path into nested batches ([inputs, field]: batch['inputs']['field'])"


def check_places(step: Step) -> None:
    """Check the places the built-in methods ``step`` keeps look things up at: ``inputs``
    (for :meth:`Step.forward`), ``target`` (:meth:`Step.loss`, :meth:`Step.metrics`) and
    ``task`` (:meth:`Step.task_ids`), each an index, a key, a path of them or a function.

    :raises ConfigError: naming the option (``step.options.target``), or the class attribute,
        and the part of it that is not a place.
    """
    cls = type(step)
    if cls.forward is Step.forward:
        where, key = _raw(step, "inputs"), _option(step, "inputs")
        if isinstance(where, Mapping):
            for name, place in where.items():
                if not isinstance(name, str):
                    raise ConfigError(key, f"the keyword {name!r} is not a string")
                _check_place(place, f"{key}.{name}")
        elif isinstance(where, list | tuple):  # positional arguments
            for i, place in enumerate(where):
                _check_place(place, f"{key}[{i}]")
        else:
            _check_place(where, key)
    if cls.loss is Step.loss or cls.metrics is Step.metrics:
        _check_place(_raw(step, "target"), _option(step, "target"))
    if cls.task_ids is Step.task_ids and _raw(step, "task") is not None:
        _check_place(_raw(step, "task"), _option(step, "task"))


def _check_place(where: Any, key: str) -> None:
    if callable(where) or _is_key(where):
        return
    if isinstance(where, list | tuple) and where:
        for depth, part in enumerate(where):
            if not _is_key(part):
                raise ConfigError(
                    f"{key}[{depth}]", f"{part!r} is not an index or a key, and {_PATH}"
                )
        return
    raise ConfigError(key, f"{where!r} is not a place in the batch: an index or a key; {_PATH}")


def _is_key(part: Any) -> bool:
    return isinstance(part, int | str) and not isinstance(part, bool)


def _option(step: Step, name: str) -> str:
    """The config key that set ``step``'s attribute ``name``: its option, or its class's."""
    if name in vars(step):
        return f"step.options.{name}"
    return f"step.factory ({type(step).__qualname__}.{name})"
