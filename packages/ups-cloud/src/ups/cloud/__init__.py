"""ups-cloud: launchers for ups, which start a config's training somewhere and follow it.

``local`` runs ``torch.distributed.run`` on this machine as a detached job whose record, log and
exit status live in its run folder, so it can be followed and cancelled from any later process
(:class:`LocalLauncher`); ``slurm`` submits an ``sbatch`` script (:class:`SlurmLauncher`);
``vastai`` and ``vultr`` rent cloud machines (:class:`VastAILauncher`, :class:`VultrLauncher`),
each given the start-up script :class:`StartupScript` renders. Select one with
``launch: {name: local}``; its options class says what ``launch.options`` takes.

Its names are imported when first used (PEP 562): ``import ups.cloud`` imports no launcher.
The modules beneath it (``_name.py``) are private; :mod:`ups.cloud.plugin` is the entry point.
"""

from typing import TYPE_CHECKING

from ups.core import JobState, lazy_exports

if TYPE_CHECKING:
    from ._local import JobRecord, LocalLauncher, LocalLauncherOptions
    from ._options import CloudOptions
    from ._slurm import SlurmLauncher, SlurmOptions
    from ._startup import Env, StartupScript, upload
    from ._vastai import VastAIError, VastAILauncher, VastAILauncherOptions
    from ._vultr import VultrError, VultrLauncher, VultrLauncherOptions

State = JobState
"""The former name of :class:`ups.core.JobState`, what every launcher's ``status`` returns."""

_EXPORTS = {
    "JobRecord": "._local",
    "LocalLauncher": "._local",
    "LocalLauncherOptions": "._local",
    "CloudOptions": "._options",
    "SlurmLauncher": "._slurm",
    "SlurmOptions": "._slurm",
    "VastAIError": "._vastai",
    "VastAILauncher": "._vastai",
    "VastAILauncherOptions": "._vastai",
    "VultrError": "._vultr",
    "VultrLauncher": "._vultr",
    "VultrLauncherOptions": "._vultr",
    "Env": "._startup",
    "StartupScript": "._startup",
    "upload": "._startup",
}

__all__ = [
    "CloudOptions",
    "Env",
    "JobRecord",
    "LocalLauncher",
    "LocalLauncherOptions",
    "SlurmLauncher",
    "SlurmOptions",
    "StartupScript",
    "State",
    "VastAIError",
    "VastAILauncher",
    "VastAILauncherOptions",
    "VultrError",
    "VultrLauncher",
    "VultrLauncherOptions",
    "upload",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
