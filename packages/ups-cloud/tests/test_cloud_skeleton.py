"""What the cloud launchers share (:mod:`ups.cloud._cloud`, :mod:`ups.cloud._options`): one
definition of each option both have, one handle format, one wait. Each launcher's submit with
rollback, waits and deletes run against its loopback server in test_cloud_vastai.py and
test_cloud_vultr.py."""

from __future__ import annotations

import re
import time
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ups.cloud import (
    CloudOptions,
    VastAILauncher,
    VastAILauncherOptions,
    VultrLauncher,
    VultrLauncherOptions,
)
from ups.cloud._cloud import wait_until
from ups.cloud._vultr import DEFAULT_BASE_URL
from ups.core import ConfigError, UsageError, structure

PLAN: dict[str, Any] = {"plan": "vcg-a100-1c-6g-4vram", "region": "ewr"}
PER_CLOUD_DEFAULT = {"api_key_env", "url", "poll_s"}
"""The shared options whose default is each cloud's own (its key's variable, its API)."""


def vultr(**options: Any) -> VultrLauncher:
    return VultrLauncher(options=VultrLauncherOptions(**PLAN, **options))


def vastai() -> VastAILauncher:
    return VastAILauncher(options=VastAILauncherOptions())


@pytest.mark.parametrize("options", [VastAILauncherOptions, VultrLauncherOptions])
def test_an_option_both_clouds_have_is_defined_once(options: type[CloudOptions]) -> None:
    """Same name, type, validator and converter in both (the base's field itself, but for
    the cloud's own default); what only one cloud has is not in the base."""
    shared = {f.name: f for f in attrs.fields(CloudOptions)}
    own = {f.name: f for f in attrs.fields(options)}
    for name, field in shared.items():
        mine = own[name]
        assert (mine.type, mine.validator, mine.converter) == (
            field.type,
            field.validator,
            field.converter,
        ), name
        if name not in PER_CLOUD_DEFAULT:
            assert mine.default == field.default, name
    both = {f.name for f in attrs.fields(VastAILauncherOptions)} & {
        f.name for f in attrs.fields(VultrLauncherOptions)
    }
    # retries counts attempts on vastai (its client's), retries after the first on vultr.
    assert both - set(shared) == {"retries"}


@pytest.mark.parametrize("given_as", ["url", "base_url"])
def test_vultr_reads_url_and_its_former_name(given_as: str) -> None:
    api = "http://127.0.0.1:9/v2"
    from_config = structure(VultrLauncherOptions, {**PLAN, given_as: api}, "launch.options")
    assert from_config == VultrLauncherOptions(**PLAN, url=api)
    assert from_config.url == api and from_config.base_url is None
    assert VultrLauncherOptions(**PLAN).url == DEFAULT_BASE_URL
    with pytest.raises(ConfigError, match=r"^launch\.options: give url or base_url"):
        structure(VultrLauncherOptions, {**PLAN, "url": api, "base_url": api}, "launch.options")


ids = st.lists(st.integers(0, 2**40), min_size=1, max_size=5)
vultr_ids = st.lists(
    st.from_regex(r"[a-z0-9]{1,8}(-[a-z0-9]{1,8}){0,4}", fullmatch=True), min_size=1, max_size=5
)


VASTAI = vastai()  # made once: the first import of the vastai client takes a while
VULTR = vultr()


@given(instances=ids)
def test_a_vastai_handle_names_its_instances(instances: list[int]) -> None:
    handle = VASTAI._handle(instances)
    assert handle == "vastai:" + ",".join(map(str, instances))
    assert VASTAI._ids(handle) == instances


@given(instances=vultr_ids)
def test_a_vultr_handle_names_its_instances(instances: list[str]) -> None:
    assert VULTR._ids(VULTR._handle(instances)) == instances


@pytest.mark.parametrize("handle", ["local:x", "vultr:", "vastai:a,,b", "vultr:../x", "slurm:1:/x"])
def test_a_handle_of_another_launcher_is_refused_naming_the_form(handle: str) -> None:
    for launcher in (VASTAI, VULTR):
        name = launcher.NAME
        expected = (
            f"{name}: {handle!r} is not a {name} handle ({name}:ID1,ID2,...), so not a handle "
            "of this launcher"
        )
        with pytest.raises(UsageError, match=f"^{re.escape(expected)}$"):
            launcher.status(handle)


def test_wait_until_returns_what_it_saw_ready_or_says_it_was_late() -> None:
    seen: list[int] = []

    def look() -> int:
        seen.append(len(seen))
        return seen[-1]

    assert wait_until(look, lambda n: n == 3, timeout_s=5, poll_s=0.01, late=RuntimeError) == 3
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^last seen: \d+$"):
        wait_until(
            look,
            lambda n: False,
            timeout_s=0.1,
            poll_s=0.01,
            late=lambda n: RuntimeError(f"last seen: {n}"),
        )
    assert time.monotonic() - start >= 0.1


@pytest.mark.parametrize("make", [vastai, vultr])
def test_cancel_without_a_key_says_so_before_asking(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A usage error (``ups cancel`` exits 2), not a failure to delete (nothing was asked)."""
    launcher = make()
    monkeypatch.delenv(launcher.options.api_key_env, raising=False)
    message = f"{launcher.NAME}: no API key in ${launcher.options.api_key_env}"
    with pytest.raises(UsageError, match=f"^{re.escape(message)}"):
        launcher.cancel(f"{launcher.NAME}:1")
