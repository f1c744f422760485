"""ups-cloud: launchers for ups, which start a config's training somewhere and follow it.

``local`` runs ``torch.distributed.run`` on this machine as a detached job whose record, log
and exit status live in its run folder, so it can be followed and cancelled from any later
process; see :mod:`ups.cloud.local`. Select it with ``launch: {name: local}``.
"""

from .local import LaunchRecord, LocalLauncher, LocalLauncherOptions, State

__all__ = ["LaunchRecord", "LocalLauncher", "LocalLauncherOptions", "State"]
