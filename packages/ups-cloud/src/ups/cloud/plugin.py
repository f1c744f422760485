"""The ``ups-cloud`` plugin: registers its launchers with the ups engine."""

from __future__ import annotations

from ups.core import LauncherPlugin, hookimpl

from .local import LocalLauncher, LocalLauncherOptions


@hookimpl
def ups_launchers() -> list[LauncherPlugin]:
    return [
        LauncherPlugin(
            name="local",
            factory=LocalLauncher,
            options=LocalLauncherOptions,
            description="torch.distributed.run on this machine, detached, followed by file",
        )
    ]
