"""The ``ups-cloud`` plugin: registers its launchers with the ups engine.

A launcher's module is imported when the launcher is selected, not when listed.
"""

from __future__ import annotations

from ups.core import LauncherPlugin, hookimpl, imported


@hookimpl
def ups_launchers() -> list[LauncherPlugin]:
    return [
        LauncherPlugin(
            name="local",
            factory=imported("ups.cloud:LocalLauncher"),
            options=imported("ups.cloud:LocalLauncherOptions"),
            description="torch.distributed.run on this machine, detached, followed by file",
        ),
        LauncherPlugin(
            name="slurm",
            factory=imported("ups.cloud:SlurmLauncher"),
            options=imported("ups.cloud:SlurmOptions"),
            description="an sbatch script running torch.distributed.run through srun",
        ),
        LauncherPlugin(
            name="vastai",
            factory=imported("ups.cloud:VastAILauncher"),
            options=imported("ups.cloud:VastAILauncherOptions"),
            description="VastAI GPU instances: offer search, create with the start-up script",
        ),
        LauncherPlugin(
            name="vultr",
            factory=imported("ups.cloud:VultrLauncher"),
            options=imported("ups.cloud:VultrLauncherOptions"),
            description="Vultr cloud GPU instances over the v2 REST API, start-up script as user data",
        ),
    ]
