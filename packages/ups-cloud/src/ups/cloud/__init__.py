"""ups-cloud: launchers for ups, which start a config's training somewhere and follow it.

``local`` runs ``torch.distributed.run`` on this machine as a detached job whose record, log
and exit status live in its run folder, so it can be followed and cancelled from any later
process; see :mod:`ups.cloud.local`. Select it with ``launch: {name: local}``.

:class:`StartupScript` renders the start-up script the cloud launchers give a machine; see
:mod:`ups.cloud.startup`.
"""

from ups.core import JobState

from .local import JobRecord, LocalLauncher, LocalLauncherOptions
from .slurm import SlurmLauncher, SlurmOptions
from .startup import Env, StartupScript, upload

State = JobState
"""The former name of :class:`ups.core.JobState`, what every launcher's ``status`` returns."""

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
