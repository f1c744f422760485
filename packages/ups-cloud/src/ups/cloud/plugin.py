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
            factory=imported("ups.cloud.local:LocalLauncher"),
            options=imported("ups.cloud.local:LocalLauncherOptions"),
            description="torch.distributed.run on this machine, detached, followed by file",
        ),
        LauncherPlugin(
            name="slurm",
            factory=imported("ups.cloud.slurm:SlurmLauncher"),
            options=imported("ups.cloud.slurm:SlurmOptions"),
            description="an sbatch script running torch.distributed.run through srun",
        ),
        LauncherPlugin(
            name="vastai",
            factory=imported("ups.cloud.vastai:VastAILauncher"),
            options=imported("ups.cloud.vastai:VastAILauncherOptions"),
            description="VastAI GPU instances: offer search, create with the start-up script",
        ),
        LauncherPlugin(
            name="vultr",
            factory=imported("ups.cloud.vultr:VultrLauncher"),
            options=imported("ups.cloud.vultr:VultrLauncherOptions"),
            description="Vultr cloud GPU instances over the v2 REST API, start-up script as user data",
        ),
    ]
