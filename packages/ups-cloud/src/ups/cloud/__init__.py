"""ups-cloud: launchers for ups, which start a config's training somewhere and follow it.

``local`` runs ``torch.distributed.run`` on this machine as a detached job whose record, log
and exit status live in its run folder, so it can be followed and cancelled from any later
process; see :mod:`ups.cloud.local`. Select it with ``launch: {name: local}``.

:class:`StartupScript` renders the start-up script the cloud launchers give a machine; see
:mod:`ups.cloud.startup`.
"""

from .local import JobRecord, LocalLauncher, LocalLauncherOptions, State
from .slurm import SlurmLauncher, SlurmOptions
from .startup import Env, StartupScript, upload

__all__ = [
    "Env",
    "JobRecord",
    "LocalLauncher",
    "LocalLauncherOptions",
    "SlurmLauncher",
    "SlurmOptions",
    "StartupScript",
    "State",
    "upload",
]
