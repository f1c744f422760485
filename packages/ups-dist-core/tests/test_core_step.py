"""The training-step contract on real process groups: a model of two inputs, dict batches, a
loss and metrics of the user's, per task; N ranks ≡ one process, accumulation ≡ a big batch,
workers ≡ no workers; and every bad step or batch named in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ups.core import ConfigError, Step, StepError, load_config, load_plugins, train
from ups.core.config._validate import validate
from ups.core.engine._batches import BatchError
from ups.core.testing import assert_bitwise_equal, assert_params_close, read_checkpoint

STEP_MODULE = '''
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from ups.core import Step


class DictData(Dataset):
    """Dict samples of two inputs, a target and a task id; ``noise`` adds a random transform
    in ``__getitem__`` (drawn from torch's global generator, as augmentations do)."""

    def __init__(self, n=64, noise=0.0):
        g = torch.Generator().manual_seed(1)
        self.a, self.b = torch.randn(n, 3, generator=g), torch.randn(n, 2, generator=g)
        self.task = torch.arange(n) % 2
        self.y = self.a.sum(1, keepdim=True) * (1 + self.task[:, None]) + self.b[:, :1]
        self.noise = noise

    def __len__(self):
        return len(self.a)

    def __getitem__(self, i):
        a = self.a[i] + self.noise * torch.randn(3) if self.noise else self.a[i]
        return {"a": a, "b": self.b[i], "y": self.y[i], "task": self.task[i]}


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fa, self.fb, self.out = nn.Linear(3, 8), nn.Linear(2, 8), nn.Linear(8, 1)

    def forward(self, a, b):
        return self.out(torch.tanh(self.fa(a) + self.fb(b)))


class RegressionStep(Step):
    task = "task"

    def forward(self, model, batch):
        return model(batch["a"], b=batch["b"])

    def loss(self, outputs, batch):
        return ((outputs - batch["y"]) ** 2).mean(dim=1)

    def metrics(self, outputs, batch):
        error = (outputs - batch["y"]).abs().squeeze(1)
        return {"mae": error, "max_err": error.max()}


class ColumnLoss(RegressionStep):
    def loss(self, outputs, batch):
        return (outputs - batch["y"]) ** 2


class FloatLoss(RegressionStep):
    def loss(self, outputs, batch):
        return 1.0


class NaNLoss(RegressionStep):
    def loss(self, outputs, batch):
        return super().loss(outputs, batch) * float("nan")


class Opaque:
    """A batch of neither tensors nor containers nor an object with ``.to``: not movable."""


def opaque_collate(samples):
    return Opaque()


class Stream(IterableDataset):
    def __iter__(self):
        return iter(())


def build_data(n=64, noise=0.0):
    return DictData(n, noise)


def build_model():
    return TwoInputs()


def build_stream():
    return Stream()
'''


def project(folder: Path, **sections: dict[str, Any]) -> Path:
    """A project training :class:`TwoInputs` on dict batches with ``RegressionStep``."""
    config: dict[str, Any] = {
        "run": {"name": "steps", "output_dir": str(folder / "runs"), "log_every": 2},
        "model": {"factory": "steps.py:build_model"},
        "data": {"factory": "steps.py:build_data", "tasks": ["t0", "t1"]},
        "step": {"factory": "steps.py:RegressionStep"},
        "metrics": {"reduce": {"max_err": "max"}},
        "training": {"epochs": 2, "batch_size": 8, "lr": 0.05, "optimizer": "sgd"},
        "sampler": {"options": {"shuffle": False}},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "steps.py").write_text(STEP_MODULE)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def final(path: Path, nproc: int = 1, overrides: tuple[str, ...] = ()) -> tuple[Any, Any]:
    """The run's result and the model its final checkpoint holds."""
    result = train(path, nproc=nproc, overrides=overrides)
    assert result.checkpoint is not None
    state = read_checkpoint(result.checkpoint)["state"]
    return result, state["model"]


@pytest.mark.slow
def test_two_ranks_of_b_equal_one_process_of_2b_with_a_custom_step(tmp_path: Path) -> None:
    two, two_model = final(project(tmp_path / "a", training={"batch_size": 4}), nproc=2)
    one, one_model = final(project(tmp_path / "b", training={"batch_size": 8}))
    assert_params_close(two_model, one_model)
    # per-task losses and per-sample metrics, aggregated over the ranks, as one process has them
    keys = ["loss", "loss/t0", "loss/t1", "mae", "mae/t0", "mae/t1", "max_err"]
    assert len(two.metrics) == len(one.metrics) == 8
    for found, expected in zip(two.metrics, one.metrics, strict=True):
        assert [found[k] for k in keys] == pytest.approx([expected[k] for k in keys], abs=1e-6)
    assert two.metrics[0]["mae/t0"] != two.metrics[0]["mae/t1"]  # really per task


def test_accumulation_of_k_batches_equals_one_batch_of_k_b(tmp_path: Path) -> None:
    clip = {"grad_clip_norm": 0.5, "epochs": 2}
    _, accumulated = final(
        project(tmp_path / "a", training={"batch_size": 4, "accumulation_steps": 4, **clip})
    )
    _, big = final(project(tmp_path / "b", training={"batch_size": 16, **clip}))
    assert_params_close(accumulated, big)


def test_the_built_in_step_reads_dict_batches_without_code(tmp_path: Path) -> None:
    # keys for the inputs (positional), the target and the task; training.loss: mse
    builtin = {"factory": "ups.core:Step", "options": {"inputs": ["a", "b"], "target": "y"}}
    builtin["options"]["task"] = "task"
    path = project(tmp_path / "a", step=builtin, metrics={"reduce": {}})
    result, model = final(path)
    custom_result, custom = final(project(tmp_path / "b"))
    assert_params_close(model, custom)
    assert result.metrics[-1]["loss/t1"] == pytest.approx(custom_result.metrics[-1]["loss/t1"])


def test_evaluation_reports_the_steps_metrics_per_task(tmp_path: Path) -> None:
    path = project(tmp_path, eval={"factory": "steps.py:build_data", "options": {"n": 20}})
    result = train(path)
    (metrics,) = result.eval_metrics
    assert metrics["samples"] == 20
    assert {"loss/t0", "loss/t1", "mae", "mae/t0", "mae/t1", "max_err"} <= set(metrics)
    assert metrics["max_err"] >= metrics["mae"]


def test_random_transforms_draw_the_same_numbers_with_or_without_workers(tmp_path: Path) -> None:
    data = {"options": {"noise": 0.1}}
    shuffled = {"options": {"shuffle": True}}
    _, none = final(project(tmp_path / "a", data=data, sampler=shuffled))
    loader = {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 3}
    _, two = final(project(tmp_path / "b", data={**data, "loader": loader}, sampler=shuffled))
    assert_bitwise_equal(two, none)
    _, other = final(project(tmp_path / "c", data=data, sampler=shuffled, run={"seed": 1}))
    with pytest.raises(AssertionError):
        assert_bitwise_equal(other, none)  # the noise is there, and follows run.seed


def test_a_stopped_run_with_workers_resumes_bitwise(tmp_path: Path) -> None:
    # torch's sampler has no state: the resumed epoch skips its taken batches unread
    loader = {"num_workers": 2, "prefetch_factor": 4}
    sections = {"data": {"options": {"noise": 0.1}, "loader": loader}}
    _, reference = final(project(tmp_path / "a", **sections))
    path = project(tmp_path / "b", **sections, checkpoint={"resume": "latest"})
    stopped = train(path, overrides=["training.max_steps=3"])
    assert stopped.steps == 3
    _, resumed = final(path)
    assert_bitwise_equal(resumed, reference)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ("ColumnLoss", r"ColumnLoss\.loss returned a tensor of shape \(8, 1\) .* for a batch of 8"),
        ("FloatLoss", r"FloatLoss\.loss returned a float for a batch of 8; expected a float"),
    ],
)
def test_a_loss_that_is_neither_per_sample_nor_a_mean_is_named(
    tmp_path: Path, step: str, message: str
) -> None:
    path = project(tmp_path, step={"factory": f"steps.py:{step}"})
    with pytest.raises(StepError, match=rf"^at step 1: step\.factory: {message}"):
        train(path)


def test_a_nan_loss_stops_the_run_before_its_checkpoint(tmp_path: Path) -> None:
    path = project(tmp_path, step={"factory": "steps.py:NaNLoss"}, checkpoint={"every_steps": 1})
    with pytest.raises(StepError, match=r"step\.loss: a loss that is not finite before step 1"):
        train(path)
    assert not (tmp_path / "runs" / "steps" / "checkpoints").exists()


def test_a_missing_task_key_is_named_with_the_keys_there_are(tmp_path: Path) -> None:
    builtin = {"factory": "ups.core:Step", "options": {"inputs": ["a", "b"], "target": "y"}}
    builtin["options"]["task"] = "tasks"
    path = project(tmp_path, step=builtin, metrics={"reduce": {}})
    expected = r"step\.task: the batch has no key 'tasks'; its keys: a, b, y, task"
    with pytest.raises(StepError, match=expected):
        train(path)


def test_a_batch_the_device_mover_cannot_handle_is_named(tmp_path: Path) -> None:
    path = project(tmp_path, data={"loader": {"collate": "steps.py:opaque_collate"}})
    with pytest.raises(BatchError, match=r"batch: cannot move a .*\.Opaque to the device"):
        train(path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.loader.num_workers=-1", r"data\.loader\.num_workers: -1 is not allowed"),
        ("data.loader.prefetch_factor=2", r"data\.loader\.prefetch_factor: needs worker"),
        ("data.loader.collate=steps.py:nothing", r"data\.loader\.collate: .* no attribute"),
        ("step.factory=steps.py:Missing", r"step\.factory: .* no attribute 'Missing'"),
        ("metrics.factory=steps.py:build_model", r"metrics\.factory: is for the built-in step"),
        ("step.options.width=3", r"step\.options: .*unexpected keyword argument 'width'"),
    ],
)
def test_bad_input_is_refused_before_training_naming_the_key(
    tmp_path: Path, override: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_project(project(tmp_path), override)


def test_an_iterable_dataset_is_refused_naming_data_factory(tmp_path: Path) -> None:
    path = project(tmp_path, data={"factory": "steps.py:build_stream"})
    with pytest.raises(ConfigError, match=r"^data\.factory: returned an iterable dataset"):
        train(path)


def validate_project(path: Path, override: str) -> None:
    """What ``ups validate`` and ``ups train`` check before training."""
    validate(load_config(path, [override]), load_plugins())


def test_a_step_object_from_python_runs_its_methods_on_a_dict_batch() -> None:
    step = Step(inputs={"a": "x"}, target="y", task="t")
    model = torch.nn.Linear(2, 1)

    def forward(a: torch.Tensor) -> torch.Tensor:
        return model(a)

    batch = {"x": torch.ones(3, 2), "y": torch.zeros(3, 1), "t": torch.tensor([0, 1, 0])}
    outputs = step.forward(forward, batch)  # type: ignore[arg-type]
    assert step.loss(outputs, batch).shape == (3,)
    assert step.task_ids(batch).tolist() == [0, 1, 0]  # type: ignore[union-attr]
    assert step.batch_size(batch) == 3
    assert Step().task_ids((batch["x"], batch["y"])) is None  # a 2-tuple has no task ids
    with pytest.raises(StepError, match=r"step\.criterion: 'huber' is not a loss; allowed"):
        Step(criterion="huber")


def task_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["t"] * 0 + 1


def absolute_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs - targets).abs()


class FunctionsOnTheClass(Step):
    """Functions set as class attributes are called as they are, not bound to the step."""

    inputs = "x"
    target = "y"
    task = task_of
    criterion = absolute_error


class TokenMean(Step):
    """A loss averaged over tokens, not samples: ``(mean, tokens)``."""

    def loss(self, outputs: Any, batch: Any) -> tuple[torch.Tensor, int]:
        return outputs.sum() / 40, 40


def test_functions_set_on_a_subclass_are_not_bound_to_the_step() -> None:
    step = FunctionsOnTheClass()
    batch = {"x": torch.ones(3, 2), "y": torch.zeros(3, 1), "t": torch.tensor([0, 1, 0])}
    outputs = step.forward(torch.nn.Linear(2, 1), batch)
    assert step.task_ids(batch).tolist() == [1, 1, 1]  # type: ignore[union-attr]
    assert step.loss(outputs, batch).shape == (3,)  # type: ignore[union-attr]


def test_a_mean_loss_counts_for_the_samples_it_says_it_averages() -> None:
    from ups.core import RunContext
    from ups.core.dist._watchdog import Watchdog
    from ups.core.engine._update import Forward
    from ups.core.observe._metrics import LossWindow
    from ups.core.observe._step_metrics import UserMetrics

    ctx = RunContext()
    metrics = UserMetrics({}, ("all",), ctx.device)
    forward = Forward(TokenMean(), ctx, "fp32", metrics, Watchdog(ctx, "test"), pinned=False)
    loss, taken = forward(torch.nn.Identity(), (torch.full((4, 10), 2.0), torch.zeros(4)))
    assert (loss.mean.item(), loss.count, loss.kind) == (2.0, 40, "count")
    assert (taken.samples, taken.weight) == (4, 40)
    window = LossWindow((), ctx.device)
    taken.count(window, forward.metrics)
    window.add(torch.full((10,), 8.0), None)  # ten samples of 8, per sample
    taken.count(window, forward.metrics)  # 40 tokens of 2 again
    result = window.report(ctx).result()
    assert result["loss"] == pytest.approx((80 * 2 + 10 * 8) / 90)


class Watched:
    """What the watchdog says this rank runs, seen from inside the user code."""

    def __init__(self, watchdog: Any) -> None:
        self.watchdog, self.seen = watchdog, []

    def see(self) -> None:
        self.seen.append(self.watchdog.post().user)


class SeenModel(torch.nn.Module):
    def __init__(self, watched: Watched) -> None:
        super().__init__()
        self.watched = watched

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.watched.see()
        return x


class OwnStep(Step):
    watched: Watched

    def forward(self, model: torch.nn.Module, batch: Any) -> Any:
        self.watched.see()
        return super().forward(model, batch)

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        self.watched.see()
        return outputs.sum(dim=1)  # type: ignore[no-any-return]


def test_the_watchdog_names_the_user_code_a_step_runs() -> None:
    from ups.core import RunContext
    from ups.core.dist._watchdog import Watchdog
    from ups.core.engine._update import Forward
    from ups.core.observe._step_metrics import UserMetrics

    ctx = RunContext()
    watched = Watched(Watchdog(ctx, "test"))
    OwnStep.watched = watched
    for step in (Step(), OwnStep()):
        metrics = UserMetrics({}, ("all",), ctx.device)
        forward = Forward(step, ctx, "fp32", metrics, watched.watchdog, pinned=False)
        forward(SeenModel(watched), (torch.ones(2, 3), torch.zeros(2, 3)))
        watched.see()
    assert watched.seen == [
        None,  # the built-in step's forward and loss are ups's
        None,
        "step.factory (OwnStep.forward)",
        "step.factory (OwnStep.forward)",  # the model, called from the step's forward
        "step.factory (OwnStep.loss)",
        None,
    ]


class Scaled(torch.nn.Module):
    """Its input times one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class OwnLoss(Step):
    """The built-in loss, as a step of one's own: per sample, as :meth:`Step.loss` gives it."""

    def loss(self, outputs: Any, batch: Any) -> Any:
        return super().loss(outputs, batch)


@settings(max_examples=25, deadline=None)
@given(
    criterion=st.sampled_from(["mse", "l1"]),
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_the_built_in_loss_by_name_taken_as_one_mean_weighs_and_reports_as_per_sample(
    criterion: str, shape: list[int], seed: int
) -> None:
    """The built-in step's ``mse`` or ``l1`` is taken as the batch's mean in one operation
    (with one task, the report adds up that mean; with several, per-sample losses taken
    without gradients); its gradient and the report are the per-sample path's."""
    from ups.core import RunContext
    from ups.core.dist._watchdog import Watchdog
    from ups.core.engine._update import Forward
    from ups.core.observe._metrics import LossWindow
    from ups.core.observe._step_metrics import UserMetrics

    ctx = RunContext()
    generator = torch.Generator().manual_seed(seed)
    batch = (torch.randn(*shape, generator=generator), torch.randn(*shape, generator=generator))
    results = []
    for per_task, averaged in ((False, True), (True, True), (None, False)):
        model = Scaled()
        step = Step(criterion=criterion)
        if averaged is False:  # the per-sample path, as a step of one's own would take it
            step = OwnLoss(criterion=criterion)
        forward = Forward(
            step,
            ctx,
            "fp32",
            UserMetrics({}, ("all",), ctx.device),
            Watchdog(ctx, "test"),
            pinned=False,
            per_task=bool(per_task),
        )
        loss, taken = forward(model, batch)
        assert loss.averaged is averaged
        assert taken.loss.dim() == (0 if per_task is False else 1)
        (loss.mean + loss.total).backward()  # type: ignore[no-untyped-call]
        window = LossWindow((), ctx.device)
        taken.count(window, forward.metrics)
        results.append((model.weight.grad, window.report(ctx).result()))
    *fused, (grad, report) = results
    for fused_grad, fused_report in fused:
        torch.testing.assert_close(fused_grad, grad, rtol=1e-5, atol=1e-6)
        assert fused_report == pytest.approx(report, rel=1e-6)


def test_outputs_and_target_of_other_shapes_keep_the_per_sample_loss() -> None:
    """Where outputs and target differ in shape, the step's own ``loss`` says what the loss
    is (here a broadcast): no mean is taken in its place."""
    from ups.core import RunContext
    from ups.core.dist._watchdog import Watchdog
    from ups.core.engine._update import Forward
    from ups.core.observe._step_metrics import UserMetrics

    ctx = RunContext()
    forward = Forward(
        Step(),
        ctx,
        "fp32",
        UserMetrics({}, ("all",), ctx.device),
        Watchdog(ctx, "test"),
        pinned=False,
    )
    with pytest.warns(UserWarning, match="broadcast"):
        loss, _ = forward(torch.nn.Identity(), (torch.zeros(3, 2), torch.ones(3, 1)))
    assert (loss.averaged, loss.kind, tuple(loss.value.shape)) == (False, "samples", (3,))
