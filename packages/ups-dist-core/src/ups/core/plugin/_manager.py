"""The plugin manager factory and the registry of what plugins provide.

:func:`load_plugins` registers the built-in plugins explicitly, then every module listed under
the ``ups`` entry-point group, then checks that every ``ups_*`` implementation matches a spec.
Two environment variables steer it (read when it is called):

``UPS_DISABLE_PLUGIN_AUTOLOAD=1``
    load no entry points: only the built-ins and plugins passed in explicitly.
``UPS_BLOCK_PLUGINS=name,name``
    skip the named plugins (entry-point names, or ``ups-dist-core`` for the built-ins). A
    config section ``plugins.NAME`` named after a blocked plugin (``mlflow``, ``wandb``: a
    plugin's section takes its name) is accepted and ignored, so that blocking turns a plugin
    off whatever the config says; a section that no installed plugin provides stays an error.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, overload

import attrs
import pluggy
import structlog

from ..config._errors import ConfigError, UsageError, did_you_mean, one_of
from ..config._structure import structure
from . import hookspecs
from ._markers import NAME
from ._records import (
    CheckpointBackendPlugin,
    CommandPlugin,
    CommHookPlugin,
    LauncherPlugin,
    NoOptions,
    PluginRecord,
    SamplerPlugin,
    SectionPlugin,
    StrategyPlugin,
)

if TYPE_CHECKING:
    from ..config._config import Config

log = structlog.get_logger()

ENTRY_POINT_GROUP = NAME
AUTOLOAD_ENV = "UPS_DISABLE_PLUGIN_AUTOLOAD"
BLOCK_ENV = "UPS_BLOCK_PLUGINS"
BUILTIN_NAME = "ups-dist-core"
BUILTINS = "ups.core.plugin._builtins"
"""The module of the built-in plugin, registered under the name ``ups-dist-core``."""

Family = Literal["sampler", "comm_hook", "strategy", "checkpoint", "launcher", "command", "section"]
FAMILIES: Mapping[Family, tuple[str, type[PluginRecord]]] = {
    "sampler": ("ups_samplers", SamplerPlugin),
    "comm_hook": ("ups_comm_hooks", CommHookPlugin),
    "strategy": ("ups_strategies", StrategyPlugin),
    "checkpoint": ("ups_checkpoint_backends", CheckpointBackendPlugin),
    "launcher": ("ups_launchers", LauncherPlugin),
    "command": ("ups_commands", CommandPlugin),
    "section": ("ups_config_sections", SectionPlugin),
}
"""Each registration family: its hook and the record type the hook returns."""

Status = Literal["enabled", "blocked", "failed"]


@attrs.frozen
class PluginInfo:
    """A plugin the manager knows of, loaded or not."""

    name: str
    distribution: str
    version: str
    status: Status
    error: str = ""
    """Why it failed to load, when ``status`` is ``failed``."""

    @property
    def source(self) -> str:
        """``distribution version``, as messages name it."""
        return f"{self.distribution} {self.version}".strip()


@attrs.frozen
class Provided:
    """A record and the plugin that registered it."""

    record: PluginRecord
    plugin: str
    replaced_builtin: bool = False
    """Whether it took the name of a built-in (say a third party's ``torch`` sampler)."""


class Registry:
    """The loaded plugins and, per family, the records they provide by name."""

    def __init__(self, manager: pluggy.PluginManager, plugins: tuple[PluginInfo, ...]) -> None:
        self.manager = manager
        self.plugins = plugins
        self._records: dict[Family, dict[str, Provided]] = {}

    def records(self, family: Family) -> dict[str, Provided]:
        """Every record of ``family`` by name.

        :raises UsageError: when two plugins claim one name, or a hook returns a wrong type.
        """
        if family not in self._records:
            self._records[family] = self._collect(family)
        return self._records[family]

    def get(
        self,
        family: Family,
        name: str,
        key: str,
        offer: Iterable[str] | None = None,
        *,
        factory: bool = True,
    ) -> PluginRecord:
        """The record of ``family`` called ``name``, selected by the config at ``key``, its
        ``factory`` and ``options`` imported if named with :func:`ups.core.imported`.

        :param offer: the names an error offers, when not every record fits ``key`` (the
            training samplers for ``sampler``); all of the family's by default.
        :param factory: ``False``: import the options only, all that checking a config needs
            (``ups validate`` imports no factory's module, nor the torch it may import).
        :raises ConfigError: naming ``key``, the plugins available, and any that failed to load.
        """
        records = self.records(family)
        if name in records:
            return records[name].record.loaded(factory=factory)  # type: ignore[no-any-return]
        available = list(records if offer is None else offer)
        failed = [p for p in self.plugins if p.status == "failed"]
        note = "".join(
            f"; plugin {p.name!r} ({p.source}) failed to load: {p.error}" for p in failed
        )
        raise ConfigError(
            key,
            f"unknown {family.replace('_', ' ')} {name!r}; available: {one_of(available)}"
            f"{did_you_mean(name, available)}{note}",
        )

    @overload
    def select(
        self,
        family: Literal["sampler"],
        name: str,
        options: Mapping[str, Any],
        key: str,
        *,
        factory: bool = True,
    ) -> tuple[SamplerPlugin, Any]: ...

    @overload
    def select(
        self,
        family: Literal["comm_hook"],
        name: str,
        options: Mapping[str, Any],
        key: str,
        *,
        factory: bool = True,
    ) -> tuple[CommHookPlugin, Any]: ...

    @overload
    def select(
        self,
        family: Literal["strategy"],
        name: str,
        options: Mapping[str, Any],
        key: str,
        *,
        factory: bool = True,
    ) -> tuple[StrategyPlugin, Any]: ...

    @overload
    def select(
        self,
        family: Literal["checkpoint"],
        name: str,
        options: Mapping[str, Any],
        key: str,
        *,
        factory: bool = True,
    ) -> tuple[CheckpointBackendPlugin, Any]: ...

    @overload
    def select(
        self,
        family: Literal["launcher"],
        name: str,
        options: Mapping[str, Any],
        key: str,
        *,
        factory: bool = True,
    ) -> tuple[LauncherPlugin, Any]: ...

    @overload
    def select(
        self,
        family: Literal["command"],
        name: str,
        options: Mapping[str, Any],
        key: str,
        *,
        factory: bool = True,
    ) -> tuple[CommandPlugin, Any]: ...

    def select(
        self,
        family: Family,
        name: str,
        options: Mapping[str, Any],
        key: str,
        *,
        factory: bool = True,
    ) -> tuple[PluginRecord, Any]:
        """The record ``name`` of ``family`` and ``options`` built into its options class; the
        record is typed by the family (``select("sampler", ...)`` gives a ``SamplerPlugin``).

        :param key: the config section selecting it (``sampler``), for error messages.
        :param factory: as for :meth:`get`.
        :raises ConfigError: an unknown name, or an options key or value the plugin refuses.
        """
        record = self.get(family, name, f"{key}.name", factory=factory)
        try:
            return record, structure(record.options, dict(options), f"{key}.options")
        except ConfigError as error:
            replaced = self.replaced(family, name)
            if replaced is None:
                raise
            raise ConfigError(
                error.path,
                f"{error.problem}; note: {replaced}, with options {record.options.__name__}",
            ) from None

    def replaced(self, family: Family, name: str) -> str | None:
        """``<family> 'name' is not the built-in one: plugin 'p' (distribution version)
        replaced it`` when a plugin's record took the name of a built-in; else ``None``."""
        provided = self.records(family).get(name)
        if provided is None or not provided.replaced_builtin:
            return None
        return (
            f"{family.replace('_', ' ')} {name!r} is not the built-in one: "
            f"plugin {provided.plugin!r}{self._source(provided.plugin)} replaced it"
        )

    def command_sections(self) -> dict[str, type]:
        """The top-level config sections that plugin commands read, by name, each with its
        options class: a command record whose ``options`` is not ``NoOptions`` reads the section
        named like it (ups-optuna's ``sweep``). ``ups validate`` checks them (its options
        imported if named with :func:`~ups.core.imported`); ``ups train`` refuses them, as keys
        a run's config does not have."""
        found = {}
        for name, provided in self.records("command").items():
            options = provided.record.loaded(factory=False).options
            if options is not NoOptions:
                found[name] = options
        return found

    def check_sections(self, config: Config) -> None:
        """Build every ``plugins.NAME`` section of ``config`` through its plugin's options
        class (``factory=False``: the options only). A section named after a blocked plugin
        (:data:`BLOCK_ENV`) is left unchecked, logged once at info level: blocking turns the
        plugin off whatever the config says.

        :raises ConfigError: at ``plugins.NAME`` for a section no loaded plugin provides (with
            the sections available and the nearest name), at ``plugins.NAME.KEY`` for a key or
            value its options class refuses.
        """
        blocked = {p.name for p in self.plugins if p.status == "blocked"}
        for name in config.plugins:
            if name in blocked and name not in self.records("section"):
                log.info("config section of a blocked plugin ignored", section=f"plugins.{name}")
                continue
            config.section(self.get("section", name, f"plugins.{name}").options, name)

    def _source(self, plugin: str) -> str:
        """`` (distribution version)`` of the enabled plugin ``plugin``, where known."""
        found = [p.source for p in self.plugins if p.name == plugin and p.status == "enabled"]
        return f" ({found[0].strip('()')})" if found else ""

    def _collect(self, family: Family) -> dict[str, Provided]:
        hook_name, record_type = FAMILIES[family]
        found: dict[str, Provided] = {}
        for impl in getattr(self.manager.hook, hook_name).get_hookimpls():
            plugin = impl.plugin_name
            try:
                records = list(impl.function() or ())
            except Exception as error:
                raise UsageError(
                    f"plugin {plugin!r}: {hook_name} failed: {type(error).__name__}: {error}"
                ) from None
            for record in records:
                if not isinstance(record, record_type):
                    raise UsageError(
                        f"plugin {plugin!r}: {hook_name} returned "
                        f"{type(record).__name__}, expected {record_type.__name__}"
                    )
                _add(found, family, Provided(record=record, plugin=plugin))
        return found


def _add(found: dict[str, Provided], family: Family, new: Provided) -> None:
    """Add ``new``; a plugin's record replaces a built-in default of the same name, any other
    clash is an error naming both plugins."""
    old = found.get(new.record.name)
    if old is None or old.plugin == BUILTIN_NAME:
        if old is not None:
            log.warning("built-in replaced", family=family, name=new.record.name, plugin=new.plugin)
            new = attrs.evolve(new, replaced_builtin=True)
        found[new.record.name] = new
    elif new.plugin != BUILTIN_NAME:
        raise UsageError(
            f"{family.replace('_', ' ')} {new.record.name!r} is registered by both plugin "
            f"{old.plugin!r} and plugin {new.plugin!r}; uninstall one or block it with {BLOCK_ENV}"
        )


def load_plugins(
    extra: Iterable[tuple[str, object]] = (), env: Mapping[str, str] | None = None
) -> Registry:
    """Build the plugin manager: built-ins, then entry points, then ``extra`` ``(name, plugin)``.

    A plugin that fails to import, or implements a hook that has no spec, is logged and listed
    with ``status="failed"``; it only becomes an error when the config selects something it
    would have provided. A plugin's record replaces a built-in one of the same name.

    :raises UsageError: when a plugin of ``extra`` fails to register (say, a hook with no spec).
    """
    env = os.environ if env is None else env
    blocked = {n.strip() for n in env.get(BLOCK_ENV, "").split(",") if n.strip()}
    manager = pluggy.PluginManager(NAME)
    manager.add_hookspecs(hookspecs)
    core_version = _version(BUILTIN_NAME)
    infos = [_register_builtins(manager, blocked, core_version)]
    if env.get(AUTOLOAD_ENV, "").strip().lower() not in ("1", "true", "yes"):
        for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
            infos.append(_register_entry_point(manager, entry_point, blocked))
    for name, plugin in extra:
        try:
            _register(manager, plugin, name)
        except (ValueError, pluggy.PluginValidationError) as error:
            raise UsageError(f"plugin {name!r}: {error}") from None
        infos.append(PluginInfo(name, "(registered in code)", "", "enabled"))
    manager.check_pending()  # every plugin was checked as it was registered
    return Registry(manager, tuple(infos))


def _register(manager: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Register ``plugin``, refusing (and leaving out) one that implements a hook with no spec."""
    manager.register(plugin, name=name)
    specs = [
        n for n in dir(manager.hook) if n.startswith("ups_") and getattr(manager.hook, n).has_spec()
    ]
    for attr in dir(plugin):
        caller = getattr(manager.hook, attr, None)
        if manager.parse_hookimpl_opts(plugin, attr) is not None and (
            caller is None or not caller.has_spec()
        ):
            manager.unregister(plugin)
            raise pluggy.PluginValidationError(
                plugin, f"unknown hook {attr!r}{did_you_mean(attr, specs)}"
            )


def _register_builtins(
    manager: pluggy.PluginManager, blocked: set[str], version: str
) -> PluginInfo:
    if BUILTIN_NAME in blocked:
        log.info("plugin blocked", plugin=BUILTIN_NAME, env=BLOCK_ENV)
        return PluginInfo(BUILTIN_NAME, BUILTIN_NAME, version, "blocked")
    manager.register(importlib.import_module(BUILTINS), name=BUILTIN_NAME)
    return PluginInfo(BUILTIN_NAME, BUILTIN_NAME, version, "enabled")


def _register_entry_point(
    manager: pluggy.PluginManager, entry_point: metadata.EntryPoint, blocked: set[str]
) -> PluginInfo:
    dist = entry_point.dist
    dist_name = dist.metadata["Name"] if dist is not None else "(unknown distribution)"
    version = dist.version if dist is not None else ""
    if entry_point.name in blocked:
        log.info("plugin blocked", plugin=entry_point.name, distribution=dist_name, env=BLOCK_ENV)
        return PluginInfo(entry_point.name, dist_name, version, "blocked")
    if manager.has_plugin(entry_point.name):
        return PluginInfo(entry_point.name, dist_name, version, "failed", "name already loaded")
    try:
        _register(manager, entry_point.load(), entry_point.name)
    except Exception as error:
        reason = f"{type(error).__name__}: {error}"
        log.warning(
            "plugin failed to load; skipped",
            plugin=entry_point.name,
            distribution=dist_name,
            version=version,
            error=reason,
        )
        return PluginInfo(entry_point.name, dist_name, version, "failed", reason)
    return PluginInfo(entry_point.name, dist_name, version, "enabled")


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""
