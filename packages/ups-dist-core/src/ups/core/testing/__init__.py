"""Test helpers for ups and its plugins: run a function on real local process groups, the ``ups``
command in a subprocess, a tiny project to train, and the assertions the tests share."""

from ._checks import (
    assert_bitwise_equal,
    assert_params_close,
    counting_all_reduces,
    read_checkpoint,
    tracker_metrics,
)
from ._commands import SITECUSTOMIZE, WITHOUT, events, run_ups, wait_for, without
from ._project import KILLER_MODULE, TINY_MODULE, install_plugin, tiny_project, two_task_dataset
from ._ranks import free_port, kill_all_in, run_ranks, torchrun_env, two_machines

__all__ = [
    "TINY_MODULE",
    "free_port",
    "install_plugin",
    "KILLER_MODULE",
    "tracker_metrics",
    "counting_all_reduces",
    "two_task_dataset",
    "tiny_project",
    "run_ups",
    "events",
    "wait_for",
    "torchrun_env",
    "run_ranks",
    "read_checkpoint",
    "assert_params_close",
    "assert_bitwise_equal",
    "two_machines",
    "kill_all_in",
    "WITHOUT",
    "SITECUSTOMIZE",
    "without",
]
