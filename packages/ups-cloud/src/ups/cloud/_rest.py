"""A JSON REST API over HTTP(S), as a cloud launcher without a client library talks to its
cloud (the ``vultr`` launcher to Vultr's v2 API): one session, the API key only as the
``Authorization: Bearer`` header, and every failure one line naming the request.

Requests answered 429 are retried after ``Retry-After``, and reads and deletes answered 5xx with
exponential backoff (urllib3's ``Retry``); a create (``POST``) is not retried after a 5xx,
which may have created it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import requests  # type: ignore[import-untyped, unused-ignore]
from requests.adapters import HTTPAdapter  # type: ignore[import-untyped, unused-ignore]
from urllib3.util.retry import Retry

from ups.core import UsageError

from ._secrets import ApiKey

RETRY_STATUSES = (429, 500, 502, 503, 504)
"""The answers a request is tried again after."""


class _Retry(Retry):
    """urllib3's ``Retry``, but a create (POST) is only tried again after 429, which is answered
    before anything is done; a 5xx may come after the instance was made."""

    def is_retry(self, method: str, status_code: int, has_retry_after: bool = False) -> bool:
        if method.upper() == "POST":
            return status_code == 429 and bool(self.total)
        return super().is_retry(method, status_code, has_retry_after)


@attrs.define
class RestApi:
    """The API at ``base_url``; :meth:`call` sends one request."""

    name: str
    """What the API is called in messages, e.g. ``"Vultr API"``."""
    base_url: str
    key: ApiKey
    error: type[Exception]
    """What a failed request is raised as (a refused key: :class:`UsageError`)."""
    timeout_s: float
    retries: int
    """How often a request that fails with 429 or (not a create) 5xx is tried again."""
    backoff_s: float
    """urllib3's backoff factor for 5xx retries: 0, 2x, 4x, ... seconds."""
    _session: requests.Session | None = attrs.field(default=None, init=False)

    def _http(self) -> requests.Session:
        if self._session is None:
            retry = _Retry(
                total=self.retries,
                connect=self.retries,
                read=self.retries,
                status=self.retries,
                backoff_factor=self.backoff_s,
                status_forcelist=RETRY_STATUSES,
                respect_retry_after_header=True,
                raise_on_status=False,
            )
            self._session = requests.Session()
            adapter = HTTPAdapter(max_retries=retry)
            self._session.mount("http://", adapter)
            self._session.mount("https://", adapter)
        return self._session

    def call(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        auth: bool = True,
        ok_missing: bool = False,
    ) -> dict[str, Any] | None:
        """The JSON object ``METHOD base_url+path`` answers (``{}`` when empty); ``None`` for
        404 when ``ok_missing``. ``auth``: send the key.

        :raises UsageError: the key is missing or was refused (401, 403).
        :raises error: the request failed, or the answer is not a JSON object.
        """
        headers = {"Accept": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {self.key.read()}"
        what = f"{self.name} {method} {path}"
        try:
            response = self._http().request(
                method,
                self.base_url + path,
                json=body,
                params=params,
                headers=headers,
                timeout=self.timeout_s,
            )
        except requests.RequestException as error:
            raise self.error(f"{what}: {type(error).__name__}: {error}") from None
        code = response.status_code
        if ok_missing and code == 404:
            return None
        if code in (401, 403):
            raise UsageError(
                f"{what}: {code} {response.reason}: the API key from {self.key.source} was "
                "refused (is it valid, and is this machine's IP allowed?)"
            )
        if code >= 400:
            retried = f" after {self.retries} retries" if code in RETRY_STATUSES else ""
            raise self.error(f"{what}: {code} {response.reason}{retried}: {_error_text(response)}")
        if code == 204 or not response.content:
            return {}
        try:
            data = response.json()
        except ValueError:
            raise self.error(f"{what}: the answer is not JSON") from None
        if not isinstance(data, dict):
            raise self.error(f"{what}: unexpected answer {str(data)[:200]!r}")
        return data


def _error_text(response: requests.Response) -> str:
    """The ``error`` of a JSON answer, else its text: one line, at most 300 characters."""
    try:
        data = response.json()
        if isinstance(data, dict) and data.get("error"):
            return str(data["error"]).replace("\n", " ")[:300]
    except ValueError:
        pass
    return response.text.replace("\n", " ")[:300] or "(no details)"
