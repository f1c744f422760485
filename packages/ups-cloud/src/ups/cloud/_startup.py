"""The start-up script the cloud launchers give a machine: set up, train, upload, shut down.

:class:`StartupScript` renders one bash script (``StartupScript(...).render()``) that, on the
machine it is given to (as VastAI's on-start script or Vultr's user data, say):

1. checks that the secrets it is told of (``env_names``) are set in its environment;
2. writes the project's files (``files``: the config, a model module, ...) under ``workdir``;
3. installs the selected distributions at pinned versions (``pip install NAME==VERSION``);
4. runs the user's data step (a shell command), if any;
5. runs ``torch.distributed.run`` (torchrun) with ``--nproc-per-node`` processes (a number, or
   ``"gpu"``: one per GPU that ``nvidia-smi -L`` lists, at least one) and, on several machines,
   ``--nnodes N --node-rank R`` and a c10d rendezvous on the first machine, running
   ``-m ups.core train CONFIG -o ... -o run.output_dir=RUN_DIR`` as the ``local`` launcher does.
   On several machines it first finds the address and network interface the other machines
   reach this one on (see :attr:`StartupScript.network_interface`) and gives them to torchrun
   (``--local-addr``: where the process group's store is served when this machine hosts it)
   and to gloo and NCCL (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``), so that neither
   depends on the machine's hostname, which a cloud machine's peers often cannot resolve;

then, whether those steps succeeded or not (a trap on ``EXIT``):

6. writes the exit status to ``RUN_DIR/startup.exit``;
7. uploads ``RUN_DIR`` to ``upload_url`` with fsspec (``python -m ups.cloud._startup upload``),
   if one is given;
8. shuts the machine down (``shutdown_command``), if ``auto_shutdown``, so nothing bills;

and exits with the status of the first step that failed (training's, when it ran). Every line
of output of every step goes to ``RUN_DIR/startup.log`` and to stdout.

Every value is shell-quoted, and commands the user gives (``data_step``,
``shutdown_command``) run as ``bash -c COMMAND``, so no value can change the script's own
structure. Secrets are never written into the script: a step that needs one reads it from its
environment (``$NAME``), where the launcher puts it (VastAI's ``--env``, say); ``render``
refuses to produce a script that contains the value of any variable named in ``env_names``.

A launcher that ships the project from this machine to its machines builds the script from
:func:`machine_request` (the request as the machine runs it) and :func:`machine_files` (the
config and the files the user lists, read here).
"""

from __future__ import annotations

import os
import posixpath
import re
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Literal

import attrs

from ups.core import LaunchRequest, UsageError, agent_args, agent_exports, train_args

LOG_FILE = "startup.log"
"""The script's log, in the run folder: the output of every step, training's included."""
EXIT_FILE = "startup.exit"
"""The script's exit status, in the run folder, written before the upload."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# PEP 508 distribution names, and the characters of PEP 440 versions.
_DIST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+!_-]*")
# Linux interface names: at most 15 characters, no slash, colon or white space.
_INTERFACE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,14}")

NETWORK_SCRIPT = "network.sh"
"""The bash functions of a multi-machine script that find the machine's address on the job's
network (the rule: :attr:`StartupScript.network_interface`), shipped beside this module."""


def network_functions() -> str:
    """The text of :data:`NETWORK_SCRIPT`, which a multi-machine script includes."""
    return resources.files("ups.cloud").joinpath(NETWORK_SCRIPT).read_text()


def _env_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        raise UsageError(f"{what}: {name!r} is not an environment variable name")
    return name


@attrs.frozen
class Env:
    """A value the machine takes from its environment at run time, e.g. the node's rank that
    the cloud sets: ``Env("NODE_RANK")`` is rendered as ``"${NODE_RANK:?...}"`` (the script
    fails, naming it, when it is unset)."""

    name: str = attrs.field(validator=lambda _i, _a, v: _env_name(v, "Env"))

    def render(self) -> str:
        return f'"${{{self.name}:?{self.name} is not set}}"'


def _word(value: str | int | Env) -> str:
    return value.render() if isinstance(value, Env) else shlex.quote(str(value))


def _check_packages(_i: object, _a: object, packages: Mapping[str, str] | None) -> None:
    for name, version in (packages or {}).items():
        if not isinstance(name, str) or not _DIST_NAME.fullmatch(name):
            raise UsageError(f"packages: {name!r} is not a distribution name")
        if not isinstance(version, str) or not _VERSION.fullmatch(version):
            raise UsageError(
                f"packages: {name}: {version!r} is not an exact version (such as '1.2.0')"
            )


def _inside(path: str) -> bool:
    """Whether ``path`` is relative and stays inside the folder it is relative to."""
    return (
        bool(path) and not posixpath.isabs(path) and ".." not in posixpath.normpath(path).split("/")
    )


def _check_files(_i: object, _a: object, files: Mapping[str, str]) -> None:
    for path in files:
        if not _inside(path):
            raise UsageError(f"files: {path!r} must be a relative path inside workdir")


def _as_tuple(names: Iterable[str]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


MACHINE_RUN_DIR = Path("runs")
"""The run folder on a machine, under its workdir, when the request's is an absolute path."""


def _machine_config(config: Path) -> str:
    """Where the config goes under a machine's workdir: its path relative to the working
    directory, or its name when it lies outside it."""
    path = config
    if path.is_absolute():
        try:
            path = path.relative_to(Path.cwd())
        except ValueError:
            return config.name
    text = path.as_posix()
    return posixpath.normpath(text) if _inside(text) else config.name


def machine_request(request: LaunchRequest) -> LaunchRequest:
    """``request`` as a machine runs it, in its workdir, where :func:`machine_files` puts the
    config: the config at its path relative to the working directory here (its name when it
    lies elsewhere), and the run folder ``run_dir`` when relative, else ``runs`` (a local
    absolute path means nothing on the machine)."""
    run_dir = MACHINE_RUN_DIR if request.run_dir.is_absolute() else request.run_dir
    return attrs.evolve(request, config=Path(_machine_config(request.config)), run_dir=run_dir)


def machine_files(request: LaunchRequest, paths: Iterable[str] = ()) -> dict[str, str]:
    """The files a machine needs under its workdir, read now: the request's config (where
    :func:`machine_request` names it, so that the relative ``file.py:callable`` paths in it
    mean the same there) and each of ``paths``: files relative to the working directory (a
    model module, ...), written at the same relative path.

    :raises UsageError: naming a path that is not relative and inside the working directory,
        or a file that cannot be read.
    """
    files = {_machine_config(request.config): _read(request.config, "config")}
    for path in _as_tuple(paths):
        if not _inside(str(path)):
            raise UsageError(
                f"files: {str(path)!r} must be a path relative to the working directory, inside it"
            )
        files[posixpath.normpath(str(path))] = _read(Path(path), "files")
    return files


def node_upload_url(url: str | None, node_rank: int) -> str | None:
    """Where machine ``node_rank`` of a job uploads its run folder: ``url`` for the first
    machine, ``<url>/nodes/R`` for machine R > 0, so that no two machines write one place."""
    if url is None or node_rank == 0:
        return url
    return f"{url.rstrip('/')}/nodes/{node_rank}"


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as error:
        raise UsageError(f"{what}: cannot read {path}: {error.strerror}") from None


def _check_env_names(_i: object, _a: object, names: tuple[str, ...]) -> None:
    for name in names:
        _env_name(name, "env_names")


def _check_workdir(_i: object, _a: object, workdir: str) -> None:
    if not posixpath.isabs(workdir):
        raise UsageError(f"workdir must be an absolute path, not {workdir!r}")


def _check_interface(_i: object, _a: object, name: str | None) -> None:
    if name is not None and not (isinstance(name, str) and _INTERFACE.fullmatch(name)):
        raise UsageError(f"network_interface: {name!r} is not a network interface name")


def _check_nproc(_i: object, _a: object, nproc: int | Literal["gpu"] | None) -> None:
    if nproc is not None and nproc != "gpu" and not (isinstance(nproc, int) and nproc >= 1):
        raise UsageError(f"nproc_per_node must be a number >= 1 or 'gpu', not {nproc!r}")


@attrs.frozen(kw_only=True)
class StartupScript:
    """The start-up script of one machine of a job (see the module doc); :meth:`render` it."""

    request: LaunchRequest
    """What to train. ``config`` and ``run_dir`` are paths on the machine, relative to
    ``workdir`` unless absolute; ``nnodes`` machines each run this script."""
    workdir: str = attrs.field(default="/root/ups", validator=_check_workdir)
    """The absolute folder on the machine the script works in (created if missing)."""
    files: Mapping[str, str] = attrs.field(factory=dict, validator=_check_files)
    """Text files written under ``workdir`` first (relative path -> content), e.g. the config
    and the modules it names. Never put secrets here: they would be in the script."""
    python: str = "python3"
    """The Python that installs, trains and uploads."""
    packages: Mapping[str, str] | None = attrs.field(default=None, validator=_check_packages)
    """Distributions to install (name -> exact version) with ``python -m pip install``;
    ``None`` or empty: install nothing (the image has what the run needs)."""
    data_step: str | None = None
    """A shell command run (with ``bash -c``, in ``workdir``) before training, e.g. a download."""
    nproc_per_node: int | Literal["gpu"] | None = attrs.field(default=None, validator=_check_nproc)
    """Processes per machine: a number, ``"gpu"`` (one per GPU, at least one), or ``None``:
    the request's ``nproc_per_node``."""
    node_rank: int | Env = 0
    """This machine's rank among the ``nnodes`` (0 on the first); with several machines,
    usually an :class:`Env` the cloud or launcher sets."""
    rdzv_host: str | Env | None = None
    """The first machine's address, where the c10d rendezvous runs; needed when ``nnodes > 1``."""
    rdzv_port: int = 29500
    rdzv_id: str = "ups"
    """The rendezvous id, the same on every machine of a job."""
    network_interface: str | None = attrs.field(default=None, validator=_check_interface)
    """The network interface (e.g. ``enp8s0``) whose IPv4 address the other machines of a
    multi-machine job reach this one on; ignored on one machine. The script gives its address
    to torchrun (``--local-addr``) and the name to gloo and NCCL (``GLOO_SOCKET_IFNAME`` and
    ``NCCL_SOCKET_IFNAME``, unless the environment sets them already).

    ``None`` (the default): found at start, from the route to ``rdzv_host`` (``ip -4 route
    get``): when it leaves the machine (machines R > 0), its interface and source address;
    when it is this machine's own non-loopback address, the interface holding it; when it is
    a loopback address (the first machine, which vultr and vastai give ``127.0.0.1`` or
    ``localhost``), the first interface with a private (RFC 1918) address that does not carry
    the default route (a VPC's NIC beside the public one), else the default route's interface
    (a machine with one NIC); ``lo``, ``docker*``, ``br-*``, ``virbr*`` and ``veth*`` are
    never chosen there. Name the interface when the rule picks the wrong one.

    The script also tells torchrun whether this machine serves the rendezvous (``--rdzv-conf
    is_host=1`` when the route to ``rdzv_host`` is local), which torch would otherwise find out
    from the hostname. It needs ``ip`` (iproute2) and ``getent`` on the machine."""
    max_restarts: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """How often torchrun restarts the ranks after a failure (the config's
    ``distributed.max_restarts``); a restarted job resumes from its newest checkpoint."""
    upload_url: str | None = None
    """An fsspec URL (``s3://bucket/runs/x``, ``file:///data/x``, ...) the run folder is copied
    to at the end; its credentials come from the environment (``env_names``), not the URL."""
    auto_shutdown: bool = False
    """Shut the machine down at the end, whatever happened, so that nothing bills."""
    shutdown_command: str = "shutdown -h now || poweroff"
    """The shell command that does it (a cloud may need its own, e.g. ``vastai stop instance
    $CONTAINER_ID``)."""
    env_names: tuple[str, ...] = attrs.field(
        default=(), converter=_as_tuple, validator=_check_env_names
    )
    """Environment variables (API keys, storage credentials) the script requires from its
    environment; they are checked at the start and never written into the script."""

    def __attrs_post_init__(self) -> None:
        request = self.request
        if request.nnodes < 1:
            raise UsageError(f"nnodes must be >= 1, not {request.nnodes}")
        if self.nproc_per_node is None and request.nproc_per_node < 1:
            raise UsageError(f"nproc_per_node must be >= 1, not {request.nproc_per_node}")
        if request.nnodes > 1 and self.rdzv_host is None:
            raise UsageError(
                f"{request.nnodes} machines need rdzv_host, the first machine's address"
            )
        if isinstance(self.node_rank, int) and not 0 <= self.node_rank < request.nnodes:
            raise UsageError(f"node_rank {self.node_rank} is not in [0, {request.nnodes})")

    @property
    def run_dir(self) -> str:
        """The run folder on the machine: training's output, the log, what is uploaded."""
        return posixpath.join(self.workdir, str(self.request.run_dir))

    def torchrun_args(self) -> list[str]:
        """The shell words of the training command, each quoted (``$NPROC`` is the script's
        count of processes)."""
        request = self.request
        words = [shlex.quote(self.python), "-m", "torch.distributed.run"]
        words += [*agent_args(self.max_restarts), "--nproc-per-node", '"$NPROC"']
        if request.nnodes == 1:
            words.append("--standalone")
        else:
            assert self.rdzv_host is not None  # checked in __attrs_post_init__
            host = _word(self.rdzv_host)
            words += ["--nnodes", str(request.nnodes), "--node-rank", _word(self.node_rank)]
            words += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{self.rdzv_port}"]
            words += ["--rdzv-id", shlex.quote(self.rdzv_id)]
            # Found by the script (NETWORK_SCRIPT): torch's defaults come from the
            # hostname, which the other machines may not resolve (nor this one).
            words += ["--rdzv-conf", '"is_host=$UPS_IS_HOST"', "--local-addr", '"$UPS_LOCAL_ADDR"']
        overrides = (*request.overrides, f"run.output_dir={self.run_dir}")
        words += [shlex.quote(arg) for arg in train_args(request.config, overrides)]
        return words

    def render(self) -> str:
        """The script's text.

        :raises UsageError: when the text would contain the value of a variable named in
            ``env_names`` (as set in this process's environment).
        """
        q = shlex.quote
        run_dir, log_file = self.run_dir, posixpath.join(self.run_dir, LOG_FILE)
        lines = [
            "#!/usr/bin/env bash",
            "# The start-up script of a ups job, written by ups.cloud._startup.",
            "set -euo pipefail",
            f"UPS_WORKDIR={q(self.workdir)}",
            f"UPS_RUN_DIR={q(run_dir)}",
            f"UPS_LOG={q(log_file)}",
            f"UPS_PYTHON={q(self.python)}",
            "export PYTHONUNBUFFERED=1",
            *agent_exports(),
            "",
            'ups_say() { printf \'[ups-startup %s] %s\\n\' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*"; }',
            "",
            *([network_functions()] if self.request.nnodes > 1 else []),
            "ups_finish() {",
            "  local status=$?",
            "  trap - EXIT",
            "  set +e",
            "  {",
            '    ups_say "steps ended with exit status $status"',
            f"    printf '%s\\n' \"$status\" > {q(posixpath.join(run_dir, EXIT_FILE))}",
        ]
        if self.upload_url is not None:
            lines += [
                f"    ups_say {q('uploading ' + run_dir + ' to ' + self.upload_url)}",
                f'    "$UPS_PYTHON" -m ups.cloud._startup upload "$UPS_RUN_DIR" {q(self.upload_url)}'
                ' || ups_say "the upload failed"',
            ]
        if self.auto_shutdown:
            lines.append("    ups_say 'shutting the machine down'")
        lines.append('  } 2>&1 | tee -a "$UPS_LOG"')
        if self.auto_shutdown:
            lines.append(f"  bash -c {q(self.shutdown_command)}")
        lines += [
            '  exit "$status"',
            "}",
            "trap ups_finish EXIT",
            "trap 'exit 143' TERM",
            "trap 'exit 130' INT",
            "",
            "ups_steps() {",
        ]
        for name in self.env_names:
            lines.append(f'  : "${{{name}:?{name} must be set in the environment}}"')
        lines += ['  ups_say "working in $UPS_WORKDIR"', '  cd "$UPS_WORKDIR"']
        for path, content in self.files.items():
            parent = posixpath.dirname(path)
            if parent:
                lines.append(f"  mkdir -p {q(parent)}")
            lines.append(f"  printf '%s' {q(content)} > {q(path)}")
        if self.packages:
            requirements = " ".join(q(f"{n}=={v}") for n, v in self.packages.items())
            lines += [
                f"  ups_say {q('installing ' + ', '.join(self.packages))}",
                f'  "$UPS_PYTHON" -m pip install --no-input --disable-pip-version-check {requirements}',
            ]
        if self.data_step is not None:
            lines += ["  ups_say 'running the data step'", f"  bash -c {q(self.data_step)}"]
        if self.nproc_per_node == "gpu":
            lines += [
                "  NPROC=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)",
                '  if [ "${NPROC:-0}" -lt 1 ]; then NPROC=1; fi',
            ]
        else:
            lines.append(f"  NPROC={self.nproc_per_node or self.request.nproc_per_node}")
        if self.request.nnodes > 1:
            assert self.rdzv_host is not None  # checked in __attrs_post_init__
            interface = q(self.network_interface or "")
            host, rank = _word(self.rdzv_host), _word(self.node_rank)
            lines.append(f"  ups_network {rank} {host} {interface}")
        torchrun = " ".join(self.torchrun_args())
        lines += [
            f'  ups_say "training: {self.request.nnodes} machine(s), $NPROC process(es) each"',
            f"  ups_say {q('running ' + torchrun)}",
            f"  {torchrun}",
            "}",
            "",
            'mkdir -p "$UPS_RUN_DIR"',
            'ups_steps 2>&1 | tee -a "$UPS_LOG"',
            "",
        ]
        script = "\n".join(lines)
        for name in self.env_names:
            value = os.environ.get(name)
            if value and value in script:
                raise UsageError(
                    f"the start-up script would contain the value of ${name} in clear text; "
                    "keep secrets out of files, commands, paths and URLs"
                )
        return script


def upload(src: str | Path, url: str) -> list[str]:
    """Copy the folder ``src`` to the fsspec ``url`` (``url/<path in src>`` for each file), its
    exit status (``startup.exit``) last; return the URLs written. fsspec, and its package for the URL's protocol (s3fs, ...), must
    be installed."""
    import fsspec  # type: ignore[import-untyped]  # only the machine that uploads needs it

    fs, root = fsspec.core.url_to_fs(url)
    root = str(root).rstrip("/")
    written = []
    source = Path(src)
    files = (p for p in source.rglob("*") if p.is_file())
    # The exit status goes last: its presence at the URL says that everything else is there.
    for path in sorted(files, key=lambda p: (p == source / EXIT_FILE, p)):
        target = f"{root}/{path.relative_to(source).as_posix()}"
        fs.makedirs(posixpath.dirname(target), exist_ok=True)
        fs.put_file(str(path), target)
        written.append(target)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ups.cloud._startup upload SRC URL``: what the script runs to upload."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] != "upload":
        print("usage: python -m ups.cloud._startup upload SRC URL", file=sys.stderr)
        return 2
    written = upload(args[1], args[2])
    print(f"uploaded {len(written)} files to {args[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
