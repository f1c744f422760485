"""Config loading, validation messages and overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from ups.core.config._config import (
    Config,
    DuplicateKeyError,
    apply_overrides,
    config_from_mapping,
    load_config,
    parse_overrides,
    read_yaml,
)
from ups.core.config._errors import ConfigError, UsageError

BASE = {"model": {"factory": "m:f"}, "data": {"factory": "m:g"}}


def config(**sections: object) -> Config:
    return config_from_mapping({**BASE, **sections})


def error_of(**sections: object) -> str:
    with pytest.raises(ConfigError) as info:
        config(**sections)
    return str(info.value)


def test_defaults_fill_every_section() -> None:
    c = config()
    assert c.training.epochs == 1
    assert c.distributed.enabled == "auto"
    assert c.sampler.name == "torch"
    assert c.comm_hook.name == "none"
    assert c.checkpoint.name == "simple"
    assert c.launch.name is None


def test_unknown_key_names_the_path_the_allowed_keys_and_a_close_one() -> None:
    message = error_of(training={"lrr": 0.1})
    assert message.startswith("training.lrr: unknown key; allowed: ")
    assert "batch_size" in message and "did you mean 'lr'?" in message


def test_unknown_section_is_reported() -> None:
    assert error_of(trainig={}).startswith("trainig: unknown key")


def test_wrong_type_names_value_and_expected_type() -> None:
    assert error_of(training={"epochs": "ten"}) == "training.epochs: expected an integer, got 'ten'"


def test_a_boolean_is_not_an_integer() -> None:
    assert "expected an integer, got true" in error_of(training={"batch_size": True})


def test_out_of_range_value_says_what_is_allowed() -> None:
    assert error_of(training={"epochs": 0}) == "training.epochs: 0 is not allowed: must be >= 1"
    assert "must be > 0" in error_of(training={"lr": 0})


def test_literal_lists_the_choices() -> None:
    message = error_of(distributed={"backend": "mpi"})
    assert message == "distributed.backend: 'mpi' is not one of auto, gloo, nccl"


def test_enabled_takes_booleans_and_auto_only() -> None:
    assert config(distributed={"enabled": True}).distributed.enabled is True
    assert "is not a boolean or one of auto" in error_of(distributed={"enabled": "yes"})


def test_integers_are_accepted_for_floats() -> None:
    assert config(training={"lr": 1}).training.lr == 1.0


def test_missing_required_section_key() -> None:
    with pytest.raises(ConfigError, match=r"^model: is required$"):
        config_from_mapping({"data": {"factory": "m:g"}})


def test_tuple_items_are_checked_with_their_index() -> None:
    message = error_of(data={"factory": "m:g", "tasks": ["a", 3]})
    assert message == "data.tasks[1]: expected a string, got 3"


def test_overrides_set_nested_values_parsed_as_yaml() -> None:
    data = apply_overrides(BASE, ["training.lr=3e-4", "distributed.enabled=true", "run.name=x"])
    c = config_from_mapping(data)
    assert c.training.lr == pytest.approx(3e-4)
    assert c.distributed.enabled is True
    assert c.run.name == "x"
    assert "training" not in BASE  # the input is not changed


def test_override_without_equals_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="not of the form key.path=value"):
        apply_overrides(BASE, ["training.lr"])


def test_override_into_a_value_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^model.factory: is not a section"):
        apply_overrides(BASE, ["model.factory.x=1"])


def test_load_config_names_the_file_and_resolves_relative_paths(project: Path) -> None:
    c = load_config(project / "run.yaml", ["training.epochs=3"])
    assert c.training.epochs == 3
    assert c.model.factory == f"{project / 'tiny.py'}:build_model"
    (project / "bad.yaml").write_text(
        "model: {factory: a:b}\ndata: {factory: a:b}\nrun: {sed: 1}\n"
    )
    with pytest.raises(ConfigError, match=r"bad.yaml: run.sed: unknown key.*did you mean 'seed'"):
        load_config(project / "bad.yaml")


def test_missing_file_and_bad_yaml_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read config file .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "broken.yaml").write_text("model: [\n")
    with pytest.raises(UsageError, match="broken.yaml: not valid YAML"):
        load_config(tmp_path / "broken.yaml")


def test_digest_changes_with_any_value() -> None:
    assert config().digest() == config().digest()
    assert config().digest() != config(training={"lr": 0.5}).digest()


def test_yaml_exponents_are_numbers_everywhere_and_dates_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: {factory: m:f, options: {eps: 1e-6}}\ndata: {factory: m:g}\ntraining: {lr: 3e-4}\n"
    )
    c = load_config(path)
    assert c.training.lr == pytest.approx(3e-4)
    assert c.model.options["eps"] == pytest.approx(1e-6)  # free-form options too
    path.write_text("model: {factory: m:f}\ndata: {factory: m:g}\nrun: {name: 2024-01-01}\n")
    with pytest.raises(ConfigError, match="c.yaml: run.name: expected a string, got 2024-01-01"):
        load_config(path)


def test_a_bad_override_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model: {factory: m:f}\ndata: {factory: m:g}\n")
    with pytest.raises(ConfigError, match=r"^.*c.yaml: model.factory: is not a section"):
        load_config(path, ["model.factory.x=1"])


def test_a_key_given_twice_in_one_mapping_is_refused_but_a_merged_key_may_be_overridden() -> None:
    merged = read_yaml("base: &b {x: 1, y: 2}\nrun:\n  <<: *b\n  x: 3\n")
    assert merged["run"] == {"x": 3, "y": 2}
    with pytest.raises(DuplicateKeyError, match="the key 'x' is given twice .* lines 2 and 2"):
        read_yaml("- {x: 1}\n- {x: 1, y: 2, x: 3}\n")
    with pytest.raises(UsageError, match="override 'sampler={name: a, name: b}': the key 'name'"):
        parse_overrides(["sampler={name: a, name: b}"])
