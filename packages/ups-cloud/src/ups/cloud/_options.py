"""What the cloud launchers' options share: the fields both have, the checks of their values,
and the checks, at launch, of the packages they need in this process.

A config's ``launch.options`` becomes a launcher's options class through
:func:`ups.core.structure`, which names the key path (``launch.options.KEY``) of a value a
field's validator refuses with :class:`ValueError`; so the validators here raise that, saying
what is allowed, and never :class:`~ups.core.UsageError` (which would lose the key path). What
can only be checked when launching (a package this process needs: :func:`require`,
:func:`check_readable_here`) is refused with :func:`option_error`, which names the same key
path, so that ``ups launch`` and its ``--dry-run`` say what to install before anything is
created, instead of ``status``, ``logs`` or ``cancel`` failing later.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import attrs

from ups.core import ConfigError, UsageError, above, did_you_mean, one_of

from ._secrets import ApiKey
from ._startup import _as_tuple

OPTIONS_KEY = "launch.options"
"""The config section a launcher's options come from, which starts their key paths."""


def option_error(name: str, problem: str) -> ConfigError:
    """The error for option ``name`` found wrong at launch: ``launch.options.NAME: PROBLEM``."""
    return ConfigError(f"{OPTIONS_KEY}.{name}", problem)


@attrs.frozen(repr=False)
class within:  # noqa: N801 - a validator reads like a phrase: within(0, 1)
    """Validator: the value is in ``[low, high]`` (or ``None``)."""

    low: float
    high: float

    def __call__(self, _inst: object, _attr: attrs.Attribute[Any], value: float | None) -> None:
        if value is not None and not self.low <= value <= self.high:
            raise ValueError(f"must be in [{self.low:g}, {self.high:g}]")

    def __repr__(self) -> str:
        return f"within({self.low:g}, {self.high:g})"


def _path_text(value: str | os.PathLike[str] | None) -> str | None:
    return None if value is None else os.fspath(value)


def _a_path(_inst: object, _attr: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and not value.strip():
        raise ValueError("must be the path of a file")


def seconds(default: float) -> Any:
    """A field of seconds, ``> 0``, defaulting to ``default``."""
    return attrs.field(default=default, validator=above(0))


@attrs.frozen(kw_only=True)
class CloudOptions:
    """The options every cloud launcher has; each launcher's options class adds its own, and
    gives ``api_key_env`` and ``url`` their defaults."""

    api_key_env: str
    """The environment variable that holds the API key (read when ``api_key_file`` is unset)."""
    url: str
    """The root URL of the cloud's API."""
    api_key_file: str | None = attrs.field(default=None, converter=_path_text, validator=_a_path)
    """The path of a file holding the API key (``~`` is expanded; a :class:`~pathlib.Path` is
    taken too); used instead of ``api_key_env`` when given."""
    upload_url: str | None = None
    """An fsspec URL each machine's run folder is uploaded to at the end (machine R > 0:
    ``<upload_url>/nodes/R``; see :mod:`ups.cloud._startup`). Its credentials must be where it
    is read (the machines' image; this process too, where the launcher reads it), never in the
    URL."""
    ready_timeout_s: float = seconds(900.0)
    """How long each instance may take to be ready (running) before every instance created is
    deleted."""
    poll_s: float = seconds(5.0)
    """Seconds between two looks at an instance that is not ready yet."""
    auto_shutdown: bool = True
    """Shut each machine down when its script ends, so that it bills as little as it can."""
    packages: Mapping[str, str] | None = None
    """Distributions the script installs on each machine, name -> exact version."""
    data_step: str | None = None
    """A shell command run on each machine before training."""
    files: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    """Further files the run needs (e.g. a model module), as paths relative to the working
    directory: read at launch and written on each machine at the same relative path, beside
    the config (see :func:`ups.cloud._startup.machine_files`)."""
    network_interface: str | None = None
    """The NIC (e.g. ``enp8s0``) on which the machines of a multi-machine job reach each other;
    ``None``: each machine finds it at start (the rule:
    :attr:`ups.cloud._startup.StartupScript.network_interface`)."""

    def api_key(self, launcher: str) -> ApiKey:
        """The API key these options name, for the launcher ``launcher``."""
        return ApiKey(launcher, self.api_key_env, self.api_key_file)


def require(module: str, install: str, needed_by: str) -> ModuleType:
    """Import ``module`` (e.g. ``vastai.api``), which ``needed_by`` (e.g. "the vastai launcher")
    needs from an optional package.

    :param install: what to pip-install for it, e.g. ``'vastai>=1.9.1'`` (shell-quoted).
    :raises UsageError: it cannot be imported here: one line saying what to install.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        missing = (error.name or module).split(".")[0]
        raise UsageError(_not_installed(needed_by, missing, install)) from None


def check_readable_here(url: str | None, needed_by: str, key: str = "upload_url") -> None:
    """Check that this process can read the fsspec ``url`` of option ``key``: fsspec and the
    package of each of its protocols (``s3fs`` for ``s3://``) are installed.

    :param needed_by: why this process reads it, e.g. "reading it here (ups status, ups logs)".
    :raises ConfigError: one line naming the option and what to install, or an unknown protocol.
    """
    if url is None:
        return
    try:
        import fsspec  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        raise option_error(key, f"{url!r}: {_not_installed(needed_by, 'fsspec')}") from None
    for protocol in _protocols(url):
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError:
            known = fsspec.available_protocols()
            hint = did_you_mean(protocol, known) or f"; it knows {one_of(known)}"
            raise option_error(
                key, f"{url!r}: fsspec knows no protocol {protocol!r}{hint}"
            ) from None
        except ImportError as error:  # fsspec's message names the package, from the import's
            missing = getattr(error.__cause__, "name", None)
            problem = _not_installed(needed_by, missing) if missing else f"{needed_by}: {error}"
            raise option_error(key, f"{url!r}: {problem}") from None


def _not_installed(needed_by: str, package: str, install: str | None = None) -> str:
    return (
        f"{needed_by} needs the {package!r} package, which is not installed here: "
        f"pip install {install or package}"
    )


def _protocols(url: str) -> list[str]:
    """The protocols of an fsspec URL, chained ones included (``simplecache::s3://b``); a
    plain path is ``file``."""
    *chained, target = url.split("::")
    protocol, sep, _ = target.partition("://")
    return [part.partition("://")[0] for part in chained] + [protocol if sep else "file"]
