"""The plugin contract, for plugin authors: the hooks (:mod:`ups.core.plugin.hookspecs`, the
contract's table of contents), the marker ``hookimpl``, the records a registration hook returns
and the interfaces their factories build, the manager that finds plugins (``Registry``), and the
built-in plugin (``ups-dist-core``: torch's defaults, so that a bare install trains).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .._lazy import imported, lazy_exports
    from ._builtins import TorchSamplerOptions, torch_sampler
    from ._manager import Registry, load_plugins
    from ._markers import hookimpl
    from ._records import (
        TERMINAL,
        CheckpointBackendPlugin,
        Checkpointer,
        CheckpointFactory,
        CheckpointProbe,
        CommandPlugin,
        CommHookPlugin,
        JobState,
        Launcher,
        LauncherPlugin,
        LaunchRequest,
        Loaded,
        NoOptions,
        SamplerPlugin,
        SectionPlugin,
        StrategyPlugin,
        TrainResult,
        chosen,
    )

_EXPORTS = {
    "hookimpl": "._markers",
    "Registry": "._manager",
    "load_plugins": "._manager",
    "CheckpointBackendPlugin": "._records",
    "Checkpointer": "._records",
    "CheckpointFactory": "._records",
    "CheckpointProbe": "._records",
    "CommandPlugin": "._records",
    "CommHookPlugin": "._records",
    "JobState": "._records",
    "Launcher": "._records",
    "LauncherPlugin": "._records",
    "LaunchRequest": "._records",
    "Loaded": "._records",
    "NoOptions": "._records",
    "SamplerPlugin": "._records",
    "SectionPlugin": "._records",
    "StrategyPlugin": "._records",
    "TERMINAL": "._records",
    "TrainResult": "._records",
    "chosen": "._records",
    "TorchSamplerOptions": "._builtins",
    "torch_sampler": "._builtins",
    "imported": ".._lazy",
    "lazy_exports": ".._lazy",
}
"""Each public name and the module that defines it."""

__all__ = [
    "CheckpointBackendPlugin",
    "Checkpointer",
    "CheckpointFactory",
    "CheckpointProbe",
    "CommandPlugin",
    "CommHookPlugin",
    "chosen",
    "hookimpl",
    "imported",
    "JobState",
    "Launcher",
    "LauncherPlugin",
    "LaunchRequest",
    "lazy_exports",
    "load_plugins",
    "Loaded",
    "NoOptions",
    "Registry",
    "SamplerPlugin",
    "SectionPlugin",
    "StrategyPlugin",
    "TERMINAL",
    "torch_sampler",
    "TorchSamplerOptions",
    "TrainResult",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
