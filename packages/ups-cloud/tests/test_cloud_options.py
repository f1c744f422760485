"""What the cloud launchers' options share (:mod:`ups.cloud._options`), read as a config's
``launch.options`` are (:func:`ups.core.structure`) and from Python. The commands' messages
for them are in test_cloud_cli_clouds.py; a package missing here is tested there, in processes
that really lack it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ups.cloud import VastAILauncherOptions, VultrLauncherOptions
from ups.cloud._options import check_readable_here, require, within
from ups.core import ConfigError, UsageError, structure

PLAN = {"plan": "vcg-a100-1c-6g-4vram", "region": "ewr"}


@pytest.mark.parametrize("options", [VastAILauncherOptions, VultrLauncherOptions])
def test_the_key_file_is_a_path_from_a_config_string_or_from_python(
    options: type[VultrLauncherOptions], tmp_path: Path
) -> None:
    required: dict[str, Any] = PLAN if options is VultrLauncherOptions else {}
    key = tmp_path / "cloud.key"
    key.write_text("k\n")
    read = structure(options, {**required, "api_key_file": str(key)}, "launch.options")
    given_path = options(**required, api_key_file=key)
    assert read == given_path and read.api_key_file == str(key)
    assert read.api_key("x").read() == "k"
    with pytest.raises(ConfigError, match=r"^launch\.options\.api_key_file: 7 is not a string"):
        structure(options, {**required, "api_key_file": 7}, "launch.options")


@given(
    low=st.floats(-1e6, 1e6),
    span=st.floats(0, 1e6),
    value=st.floats(-3e6, 3e6),
)
def test_within_accepts_exactly_the_closed_interval(low: float, span: float, value: float) -> None:
    high = low + span
    check = within(low, high)
    if low <= value <= high:
        check(None, None, value)  # type: ignore[arg-type]
    else:
        with pytest.raises(ValueError, match=re.escape(f"must be in [{low:g}, {high:g}]")):
            check(None, None, value)  # type: ignore[arg-type]


def test_an_unknown_upload_protocol_is_named_with_the_nearest() -> None:
    with pytest.raises(ConfigError) as caught:
        check_readable_here("gcss://bucket/run", "reading it here")
    assert str(caught.value) == (
        "launch.options.upload_url: 'gcss://bucket/run': fsspec knows no protocol 'gcss'; did "
        "you mean 'gcs'?"
    )
    with pytest.raises(ConfigError, match=r"knows no protocol 'q'; it knows .*\bs3\b"):
        check_readable_here("q://bucket/run", "reading it here")
    # protocols whose implementation fsspec itself ships (the session's venv has no s3fs)
    for url in ("memory://bucket/run", "simplecache::file:///data/runs", "/data/runs", None):
        check_readable_here(url, "reading it here")


def test_a_missing_package_says_what_to_install() -> None:
    with pytest.raises(UsageError) as caught:
        require("no_such_package_ups.api", "'no-such-package>=1'", "the x launcher")
    assert str(caught.value) == (
        "the x launcher needs the 'no_such_package_ups' package, which is not installed here: "
        "pip install 'no-such-package>=1'"
    )


@pytest.mark.parametrize(("key", "value"), [("retries", -1), ("backoff_s", -0.5)])
def test_vultr_refuses_a_negative_retry_count_or_backoff_naming_its_key(
    key: str, value: float
) -> None:
    with pytest.raises(ConfigError) as caught:
        structure(VultrLauncherOptions, {**PLAN, key: value}, "launch.options")
    assert str(caught.value) == f"launch.options.{key}: {value} is not allowed: must be >= 0"
