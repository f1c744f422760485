"""The plugin manager factory and registry: discovery, conflicts, failures, switches."""

from __future__ import annotations

import types
from pathlib import Path

import attrs
import pytest
from structlog.testing import capture_logs

from ups.core import (
    CommHookPlugin,
    ConfigError,
    SamplerPlugin,
    SectionPlugin,
    UsageError,
    config_from_mapping,
    hookimpl,
    load_config,
)
from ups.core.config._config import PluginChoice
from ups.core.config._validate import select_sampler, validate
from ups.core.plugin._builtins import torch_sampler
from ups.core.plugin._manager import AUTOLOAD_ENV, BLOCK_ENV, load_plugins
from ups.core.testing import install_plugin, tiny_project


@attrs.frozen
class ReverseOptions:
    stride: int = 1


def plugin(**hooks: object) -> types.SimpleNamespace:
    """A plugin object whose ``ups_*`` attributes are the given functions, marked as hookimpls."""
    return types.SimpleNamespace(**{name: hookimpl(fn) for name, fn in hooks.items()})


def samplers(*names: str, options: type = ReverseOptions) -> types.SimpleNamespace:
    def ups_samplers() -> list[SamplerPlugin]:
        return [SamplerPlugin(name=n, factory=torch_sampler, options=options) for n in names]

    return plugin(ups_samplers=ups_samplers)


NO_AUTOLOAD = {AUTOLOAD_ENV: "1"}


def test_builtins_alone_provide_torch_defaults() -> None:
    registry = load_plugins(env=NO_AUTOLOAD)
    assert set(registry.records("sampler")) == {"torch", "shard"}
    assert set(registry.records("comm_hook")) == {"none"}
    assert set(registry.records("checkpoint")) == {"simple"}
    assert registry.records("launcher") == {}
    assert [(p.name, p.status) for p in registry.plugins] == [("ups-dist-core", "enabled")]


def test_plugins_passed_in_code_are_registered() -> None:
    registry = load_plugins(extra=[("mine", samplers("reverse"))], env=NO_AUTOLOAD)
    assert registry.records("sampler")["reverse"].plugin == "mine"


def test_a_name_claimed_twice_is_an_error_naming_both_plugins() -> None:
    registry = load_plugins(
        extra=[("first", samplers("reverse")), ("second", samplers("reverse"))], env=NO_AUTOLOAD
    )
    with pytest.raises(UsageError, match="'reverse' is registered by both plugin '.*' and plugin"):
        registry.records("sampler")
    with pytest.raises(UsageError) as info:
        registry.records("sampler")
    assert "'first'" in str(info.value) and "'second'" in str(info.value)


def test_a_plugin_replacing_a_builtin_is_warned_of_and_named_in_its_options_errors() -> None:
    with capture_logs() as logs:
        registry = load_plugins(extra=[("mine", samplers("torch"))], env=NO_AUTOLOAD)
        assert registry.records("sampler")["torch"].plugin == "mine"
    assert logs == [
        {
            "event": "built-in replaced",
            "family": "sampler",
            "name": "torch",
            "plugin": "mine",
            "log_level": "warning",
        }
    ]
    with pytest.raises(ConfigError) as info:
        registry.select("sampler", "torch", {"shuffle": False}, "sampler")
    assert str(info.value).startswith("sampler.options.shuffle: unknown key")
    assert str(info.value).endswith(
        "; note: sampler 'torch' is not the built-in one: plugin 'mine' (registered in code) "
        "replaced it, with options ReverseOptions"
    )
    plain = load_plugins(extra=[("mine", samplers("reverse"))], env=NO_AUTOLOAD)
    with pytest.raises(ConfigError, match="unknown key") as info:
        plain.select("sampler", "reverse", {"shuffle": False}, "sampler")
    assert "replaced" not in str(info.value)


def test_a_hook_returning_the_wrong_record_type_is_reported() -> None:
    def ups_samplers() -> list[CommHookPlugin]:
        return [CommHookPlugin(name="x", factory=lambda ddp, **kw: None)]

    registry = load_plugins(extra=[("wrong", plugin(ups_samplers=ups_samplers))], env=NO_AUTOLOAD)
    with pytest.raises(
        UsageError, match="'wrong': ups_samplers returned CommHookPlugin, expected SamplerPlugin"
    ):
        registry.records("sampler")


def test_an_unknown_hook_in_code_is_a_usage_error_naming_the_plugin() -> None:
    with pytest.raises(
        UsageError,
        match="^plugin 'typo': unknown hook 'ups_sampler'; did you mean 'ups_samplers'\\?$",
    ):
        load_plugins(extra=[("typo", plugin(ups_sampler=lambda: []))], env=NO_AUTOLOAD)


def test_a_hook_that_raises_is_reported_with_the_plugin_name() -> None:
    def ups_samplers() -> list[SamplerPlugin]:
        return [SamplerPlugin(name="Not Valid", factory=torch_sampler)]

    registry = load_plugins(extra=[("bad", plugin(ups_samplers=ups_samplers))], env=NO_AUTOLOAD)
    with pytest.raises(
        UsageError, match="^plugin 'bad': ups_samplers failed: ValueError: plugin name 'Not Valid'"
    ):
        registry.records("sampler")


def test_record_names_are_validated() -> None:
    with pytest.raises(ValueError, match="plugin name 'Bad Name' is not allowed"):
        SamplerPlugin(name="Bad Name", factory=torch_sampler)


def test_select_builds_options_and_names_the_key_of_a_bad_one() -> None:
    registry = load_plugins(extra=[("mine", samplers("reverse"))], env=NO_AUTOLOAD)
    record, options = registry.select("sampler", "reverse", {"stride": 3}, "sampler")
    assert record.name == "reverse" and options == ReverseOptions(stride=3)
    with pytest.raises(
        ConfigError,
        match=r"^sampler.options.strid: unknown key; allowed: stride; did you mean 'stride'\?$",
    ):
        registry.select("sampler", "reverse", {"strid": 3}, "sampler")


def test_an_unknown_name_lists_what_is_available() -> None:
    registry = load_plugins(extra=[("mine", samplers("reverse"))], env=NO_AUTOLOAD)
    with pytest.raises(ConfigError) as info:
        registry.select("sampler", "revers", {}, "sampler")
    assert str(info.value) == (
        "sampler.name: unknown sampler 'revers'; available: reverse, shard, torch; did you mean 'reverse'?"
    )


GOOD = """
from ups.core import hookimpl, SamplerPlugin
from ups.core.plugin._builtins import torch_sampler, TorchSamplerOptions

@hookimpl
def ups_samplers():
    return [SamplerPlugin(name="third", factory=torch_sampler, options=TorchSamplerOptions)]
"""


def test_entry_points_are_discovered_blocked_and_broken_ones_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_plugin(tmp_path, "ups-third", "ups_third_plugin", GOOD, "0.3")
    install_plugin(tmp_path, "ups-broken", "ups_broken_plugin", "import no_such_module\n", "0.3")
    install_plugin(
        tmp_path,
        "ups-typo",
        "ups_typo_plugin",
        "from ups.core import hookimpl\n\n@hookimpl\ndef ups_run_stat(ctx):\n    pass\n",
        "0.3",
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    with capture_logs() as logs:
        registry = load_plugins(env={})
    status = {p.name: (p.distribution, p.version, p.status) for p in registry.plugins}
    assert status["ups-third"] == ("ups-third", "0.3", "enabled")
    assert status["ups-broken"] == ("ups-broken", "0.3", "failed")
    assert status["ups-typo"] == ("ups-typo", "0.3", "failed")
    typo = next(p for p in registry.plugins if p.name == "ups-typo")
    assert (
        typo.error
        == "PluginValidationError: unknown hook 'ups_run_stat'; did you mean 'ups_run_start'?"
    )
    assert not registry.manager.has_plugin("ups-typo")
    assert "third" in registry.records("sampler")
    failed = [e for e in logs if e["event"] == "plugin failed to load; skipped"]
    assert failed[0]["plugin"] == "ups-broken" and "no_such_module" in failed[0]["error"]
    with pytest.raises(
        ConfigError,
        match="plugin 'ups-broken' \\(ups-broken 0.3\\) failed to load: ModuleNotFoundError",
    ):
        registry.get("sampler", "fancy", "sampler.name")

    blocked = load_plugins(env={BLOCK_ENV: "ups-third, ups-broken"})
    assert "third" not in blocked.records("sampler")
    assert {p.name: p.status for p in blocked.plugins}["ups-third"] == "blocked"

    no_autoload = load_plugins(env=NO_AUTOLOAD)
    assert [p.name for p in no_autoload.plugins] == ["ups-dist-core"]


def test_an_unknown_sampler_offers_only_the_samplers_of_its_kind() -> None:
    registry = load_plugins(extra=[("mine", samplers("reverse"))], env=NO_AUTOLOAD)
    for key, exact, offered in (
        ("sampler", False, "reverse, torch"),
        ("eval.sampler", True, "shard"),
    ):
        with pytest.raises(ConfigError) as info:
            select_sampler(registry, PluginChoice(name="nope"), key, exact=exact)
        assert str(info.value) == f"{key}.name: unknown sampler 'nope'; available: {offered}"


def test_validate_builds_each_plugins_section_through_its_plugin(tmp_path: Path) -> None:
    def ups_config_sections() -> list[SectionPlugin]:
        return [SectionPlugin(name="tracker", options=ReverseOptions)]

    registry = load_plugins(
        extra=[("mine", plugin(ups_config_sections=ups_config_sections))], env=NO_AUTOLOAD
    )
    tiny_project(tmp_path)
    base = {
        "model": {"factory": "tiny.py:build_model"},
        "data": {"factory": "tiny.py:build_dataset"},
    }

    def check(plugins: object) -> None:
        validate(config_from_mapping({**base, "plugins": plugins}, tmp_path), registry)

    check({"tracker": {"stride": 2}})
    config = config_from_mapping({**base, "plugins": {"tracker": {"stride": 2}}}, tmp_path)
    assert config.section(ReverseOptions, "tracker") == ReverseOptions(stride=2)
    assert config.section(ReverseOptions, "other") == ReverseOptions()
    with pytest.raises(ConfigError, match=r"^plugins.tracker.stride: expected an integer"):
        check({"tracker": {"stride": "2"}})
    with pytest.raises(ConfigError, match=r"^plugins.tracker: expected a mapping of keys"):
        check({"tracker": 3})
    with pytest.raises(
        ConfigError, match=r"^plugins.trakcer: unknown section 'trakcer'; available: tracker"
    ):
        check({"trakcer": {}})


def test_validate_warns_of_a_sampler_whose_global_batch_depends_on_the_world(
    tmp_path: Path,
) -> None:
    registry = load_plugins(extra=[("mine", samplers("reverse"))], env=NO_AUTOLOAD)
    config = load_config(tiny_project(tmp_path, sampler={"name": "reverse"}))
    warned = [w for w in validate(config, registry, nproc=2) if "world_invariant" in w]
    assert warned == [
        "sampler.name: 'reverse' does not declare that its global batch is the same on any "
        "number of ranks (world_invariant), so W ranks of batch b need not train as one "
        "process of batch W*b (`ups check` tells); torch, tensor and multitask keep it"
    ]
    torch_config = load_config(tiny_project(tmp_path / "torch"))
    assert not [w for w in validate(torch_config, registry, nproc=2) if "world_invariant" in w]
