"""The ``ups-cloud`` plugin: registers its launchers with the ups engine."""

from __future__ import annotations

from ups.core import LauncherPlugin, hookimpl

from .local import LocalLauncher, LocalLauncherOptions
from .slurm import SlurmLauncher, SlurmOptions
from .vastai import VastAILauncher, VastAILauncherOptions
from .vultr import VultrLauncher, VultrLauncherOptions


@hookimpl
def ups_launchers() -> list[LauncherPlugin]:
    return [
        LauncherPlugin(
            name="local",
            factory=LocalLauncher,
            options=LocalLauncherOptions,
            description="torch.distributed.run on this machine, detached, followed by file",
        ),
        LauncherPlugin(
            name="slurm",
            factory=SlurmLauncher,
            options=SlurmOptions,
            description="an sbatch script running torch.distributed.run through srun",
        ),
        LauncherPlugin(
            name="vastai",
            factory=VastAILauncher,
            options=VastAILauncherOptions,
            description="VastAI GPU instances: offer search, create with the start-up script",
        ),
        LauncherPlugin(
            name="vultr",
            factory=VultrLauncher,
            options=VultrLauncherOptions,
            description="Vultr cloud GPU instances over the v2 REST API, start-up script as user data",
        ),
    ]
