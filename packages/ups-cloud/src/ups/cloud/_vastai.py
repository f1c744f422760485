"""The ``vastai`` launcher: rent GPU machines on VastAI and run the start-up script on them.

``submit`` searches the offers (``POST /bundles/``: GPU name and count, GPU RAM, reliability,
price cap; cheapest first), then creates the instances (``PUT /asks/OFFER/``;
:mod:`ups.cloud._cloud`), each with ``image`` and its start-up script as its on-start command,
and waits until each is ``running`` (``GET /instances/ID/``). ``status`` reads the instances,
``logs`` fetches their logs and ``cancel`` destroys them (``DELETE /instances/ID/``). All of it
goes through the maintained ``vastai`` package's API layer (``vastai.api``), pointed at ``url``,
which holds the key in this process and tries a request up to ``retries`` times while it is
answered 429 or 502/503/504: it waits what ``Retry-After`` says (a wait over 60 s is not
retried), else 0.15 s, then 1.5 times longer each time.

Several machines: the first instance's public address and the host port mapped to its
container port ``rdzv_port`` are the others' c10d rendezvous endpoint (it itself uses
``localhost``). That port carries the rendezvous only: the process group connects to each
machine's own address on ports not mapped, so a multi-machine job trains only where the
machines reach each other directly (one private network); ``dry_run`` and ``submit`` warn
(:data:`MULTI_MACHINE_WARNING`).

The script stops its own instance at the end (``auto_shutdown``) with the instance-scoped key
VastAI puts in every container (``$CONTAINER_API_KEY``, given to the ``vastai`` CLI as
``VAST_API_KEY``), after labelling the instance ``ups-exit-STATUS`` so that ``status`` can tell
success from failure.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import json
import operator
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import attrs
import structlog

from ups.core import JobState, LaunchRequest, UsageError, above, at_least

from ._cloud import CloudLauncher, Row, exit_state
from ._options import CloudOptions, require, seconds, within
from ._startup import EXIT_FILE, StartupScript, machine_request

log = structlog.get_logger()

DEFAULT_URL = "https://console.vast.ai"
EXIT_LABEL = "ups-exit-"
"""The label the start-up script gives its instance at the end, followed by the exit status."""
VASTAI_PIN = "vastai==1.9.1"
"""What the start-up script installs on the machine to stop its instance."""
VASTAI_INSTALL = "'vastai>=1.9.1'"
"""What to pip-install here for the launcher's client (shell-quoted)."""
MAX_RETRY_AFTER_S = 60.0
"""The longest ``Retry-After`` the ``vastai`` client waits out; it does not retry a longer one."""
MULTI_MACHINE_WARNING = (
    "vastai: the machines of a multi-machine job must reach each other directly on every "
    "port: only the rendezvous port is mapped through VastAI's NAT, and the process group "
    "connects to each machine's own address (network_interface names its NIC) on other "
    "ports; machines on different hosts without a shared private network wait until the "
    "job times out, billing"
)
"""What ``dry_run`` and ``submit`` log (and the dry run shows) for a job of several machines."""
_NEAREST = 3
_OPS: dict[str, tuple[str, Callable[[Any, Any], bool]]] = {
    "eq": ("=", operator.eq),
    "gte": (">=", operator.ge),
    "lte": ("<=", operator.le),
}
"""The offer query's operators: how each is written, and whether an offer's value meets it."""
_T = TypeVar("_T")


class VastAIError(RuntimeError):
    """VastAI refused or failed a request; the message is one line and names what was left."""


class _GoneError(VastAIError):
    """The server answered 404: the instance asked for does not exist (any more)."""


@attrs.frozen(kw_only=True)
class VastAILauncherOptions(CloudOptions):
    """Options of the ``vastai`` launcher (and those of :class:`~ups.cloud.CloudOptions`:
    ``api_key_file``, ``upload_url``, ``packages``, ``files``, ...)."""

    gpu_name: str | None = None
    """The GPU model as VastAI names it (``"RTX 4090"``, ``"H100 SXM"``; ``_`` for spaces is
    accepted); ``None``: any."""
    num_gpus: int | None = attrs.field(default=None, validator=at_least(1))
    """GPUs per machine; ``None``: the request's ``nproc_per_node``."""
    min_gpu_ram_gb: float | None = attrs.field(default=None, validator=above(0))
    min_reliability: float = attrs.field(default=0.95, validator=within(0, 1))
    max_dph: float | None = attrs.field(default=None, validator=above(0))
    """The highest price per hour of one machine, in dollars."""
    image: str = "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
    disk_gb: float = attrs.field(default=40.0, validator=above(0))
    api_key_env: str = "VAST_API_KEY"
    url: str = DEFAULT_URL
    poll_s: float = seconds(10.0)
    retries: int = attrs.field(default=6, validator=at_least(1))
    """Attempts per request answered 429 or 502/503/504 (the client waits between them: see
    the module doc)."""
    shutdown_action: Literal["stop", "destroy"] = "stop"
    """``stop`` keeps the disk, the logs and the exit label; ``destroy`` removes everything."""
    rdzv_port: int = 29500
    label: str = "ups"


def _api(module: str) -> Any:
    """``vastai.api.MODULE``, the client's API layer (imported when used)."""
    return importlib.import_module(f"vastai.api.{module}")


def _call(action: str, function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``function(*args, **kwargs)``, one call of the client's API (which retries 429 and
    502-504), a failure as a one-line error (never the request's headers, which hold the key)."""
    import requests

    try:
        return function(*args, **kwargs)
    except requests.HTTPError as error:
        response = error.response
        code = response.status_code if response is not None else 0
        after = response.headers.get("Retry-After") if response is not None else None
        if code in (401, 403):
            raise UsageError(
                f"vastai: {action}: the server refused the API key (HTTP {code}); "
                "check the key in the environment variable or file the options name"
            ) from None
        if code == 429 and after is not None and _seconds(after) > MAX_RETRY_AFTER_S:
            raise VastAIError(
                f"vastai: {action}: rate limited (HTTP 429); the server asks to wait "
                f"{after} s (Retry-After), so the client did not retry: try again then"
            ) from None
        if code == 429:
            raise VastAIError(
                f"vastai: {action}: rate limited (HTTP 429) after retrying with backoff; "
                "try again later"
            ) from None
        found = _GoneError if code == 404 else VastAIError
        raise found(f"vastai: {action}: the server answered HTTP {code}") from None
    except requests.RequestException as error:
        raise VastAIError(f"vastai: {action}: {type(error).__name__}") from None


def _seconds(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0  # not a number: the client backs off by itself


class VastAILauncher(CloudLauncher[VastAILauncherOptions, int, tuple[str, int], list[Row]]):
    """Runs configs on VastAI instances (see the module doc)."""

    NAME = "vastai"
    ERROR = VastAIError
    DELETE = ("destroy", "destroyed")

    def __init__(self, *, options: VastAILauncherOptions) -> None:
        """:raises UsageError: the ``vastai`` client is not installed (every method needs it,
        the dry run's create requests included)."""
        require("vastai.api", VASTAI_INSTALL, "the vastai launcher")
        super().__init__(options=options)
        self._vast: Any = None

    def _client(self) -> Any:
        """The ``vastai`` client, with the key (made once).

        :raises UsageError: the key cannot be read.
        """
        if self._vast is None:
            self._vast = _api("client").VastClient(
                api_key=self._key.read(),
                server_url=self.options.url.rstrip("/"),
                retry=self.options.retries,
            )
        return self._vast

    # -- offers ---------------------------------------------------------------------------------

    def query(self, request: LaunchRequest) -> dict[str, Any]:
        """The offer filter sent to ``/bundles/`` (GPU RAM in MB, as the client's parser makes)."""
        o = self.options
        query: dict[str, Any] = {"num_gpus": {"eq": self._num_gpus(request)}}
        if o.gpu_name is not None:
            query["gpu_name"] = {"eq": o.gpu_name.replace("_", " ")}
        if o.min_gpu_ram_gb is not None:
            query["gpu_ram"] = {"gte": o.min_gpu_ram_gb * 1000}
        query["reliability"] = {"gte": o.min_reliability}
        if o.max_dph is not None:
            query["dph_total"] = {"lte": o.max_dph}
        return query

    def _num_gpus(self, request: LaunchRequest) -> int:
        return self.options.num_gpus or request.nproc_per_node

    def _search(self, client: Any, query: dict[str, Any], limit: int) -> list[dict[str, Any]]:
        found = _call(
            "search offers", _api("offers").search_offers, client, query=dict(query),
            order=[["dph_total", "asc"]], limit=limit, storage=self.options.disk_gb,
        )  # fmt: skip
        return list(found)

    def choose_offers(self, client: Any, request: LaunchRequest) -> list[dict[str, Any]]:
        """The ``nnodes`` cheapest matching offers; a :class:`UsageError` naming an unknown GPU
        or showing the nearest offers when too few match."""
        query = self.query(request)
        found = self._search(client, query, limit=max(request.nnodes, 1) * 4)
        if len(found) >= request.nnodes:
            return found[: request.nnodes]
        # Too few: look at the whole market (the defaults only) to say why.
        market = self._search(client, {}, limit=500)
        names = sorted({str(offer.get("gpu_name")) for offer in market})
        wanted = self.options.gpu_name
        if wanted is not None and wanted.replace("_", " ").lower() not in map(str.lower, names):
            close = difflib.get_close_matches(wanted.replace("_", " "), names, n=3, cutoff=0.4)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise UsageError(
                f"vastai: unknown GPU name {wanted!r}{hint} (offered now: {', '.join(names)})"
            )
        nearest = sorted(market, key=lambda offer: (_misses(offer, query), offer["dph_total"]))
        shown = "; ".join(_describe(offer) for offer in nearest[:_NEAREST]) or "none"
        raise UsageError(
            f"vastai: {len(found)} offer(s) match {_query_text(query)}, {request.nnodes} "
            f"needed; nearest: {shown}"
        )

    # -- the start-up script and the create request --------------------------------------------

    def script(self, request: LaunchRequest, node_rank: int, rdzv: tuple[str, int] | None) -> str:
        """The start-up script of machine ``node_rank`` (``rdzv``: the first one's endpoint)."""
        if request.nnodes == 1 or node_rank == 0:
            rdzv = "localhost", self.options.rdzv_port
        assert rdzv is not None
        host, port = rdzv
        return self._script(
            request,
            node_rank,
            host,
            nproc_per_node=self._num_gpus(request),
            rdzv_port=port,
            shutdown_command=self.shutdown_command(request),
        )

    def shutdown_command(self, request: LaunchRequest) -> str:
        """What the script runs at the end: label the instance with the exit status, then stop
        (or destroy) it, with the container's own key in the CLI's environment."""
        o = self.options
        one = attrs.evolve(machine_request(request), nnodes=1)
        exit_file = shlex.quote(f"{StartupScript(request=one).run_dir}/{EXIT_FILE}")
        cli = f'VAST_API_KEY="$CONTAINER_API_KEY" VAST_URL={shlex.quote(o.url)} vastai'
        action = "destroy instance -y" if o.shutdown_action == "destroy" else "stop instance"
        return (
            f"command -v vastai >/dev/null || python3 -m pip install -q {VASTAI_PIN}; "
            f'{cli} label instance "$CONTAINER_ID" "{EXIT_LABEL}$(cat {exit_file})"; '
            f'{cli} {action} "$CONTAINER_ID"'
        )

    def create_payload(self, request: LaunchRequest, script: str) -> dict[str, Any]:
        """The body of the create request, built by the client's own builder."""
        o = self.options
        env = {f"-p {o.rdzv_port}:{o.rdzv_port}": "1"} if request.nnodes > 1 else {}
        payload: dict[str, Any] = _api("instances").build_create_instance_payload(
            image=o.image, disk=o.disk_gb, env=env, label=o.label, onstart_cmd=script,
            runtype="ssh_proxy", cancel_unavail=True,
        )  # fmt: skip
        return payload

    # -- the Launcher protocol -----------------------------------------------------------------

    def dry_run(self, request: LaunchRequest) -> str:
        """The offer query, the chosen offers and hourly cost (when a key is set: the search is
        read-only), and each create request with its start-up script. No key appears."""
        self._check_request(request)
        query = self.query(request)
        lines = [
            f"# vastai: {request.nnodes} machine(s) of {self._num_gpus(request)} GPU(s) "
            f"at {self.options.url}",
            "# offer search: POST /api/v0/bundles/ (cheapest first)",
            json.dumps(query, sort_keys=True),
        ]
        offers: list[dict[str, Any]] = []
        try:
            client = self._client()
        except UsageError as error:
            lines.append(f"# offers not searched: {error}")
        else:
            offers = self.choose_offers(client, request)
            lines += [f"# node {rank}: offer {_describe(o)}" for rank, o in enumerate(offers)]
            cost = sum(float(offer["dph_total"]) for offer in offers)
            lines.append(f"# estimated cost: ${cost:.4f}/hour for {len(offers)} machine(s)")
        rdzv = ("FIRST_INSTANCE_PUBLIC_IP", 0) if request.nnodes > 1 else None
        for rank in range(request.nnodes):
            payload = self.create_payload(request, self.script(request, rank, rdzv))
            script, offer_id = payload.pop("onstart"), offers[rank]["id"] if offers else "OFFER_ID"
            lines += [
                f"# create node {rank}: PUT /api/v0/asks/{offer_id}/",
                json.dumps(payload, sort_keys=True),
                f"# on-start script of node {rank}:",
                script,
            ]
        if request.nnodes > 1:
            lines.append(
                "# nodes 1.. are created once node 0 runs; FIRST_INSTANCE_PUBLIC_IP:0 becomes "
                f"its public address and the host port mapped to {self.options.rdzv_port}/tcp"
            )
            lines.append(f"# warning: {MULTI_MACHINE_WARNING}")
        _warn_multi_machine(request)
        return "\n".join(lines) + "\n"

    def status(self, handle: str) -> JobState:
        """``PENDING`` until every instance runs, then ``RUNNING``; at the end, from the label
        the script sets, ``SUCCEEDED`` or ``FAILED``; ``CANCELLED`` once destroyed."""
        states = [self._state(i) for i in self._ids(handle)]
        order = (JobState.FAILED, JobState.CANCELLED, JobState.RUNNING, JobState.PENDING)
        return next((state for state in order if state in states), JobState.SUCCEEDED)

    def logs(self, handle: str) -> str:
        """Every instance's log (its on-start script's output), the first machine first."""
        client, ids, instances = self._client(), self._ids(handle), _api("instances")
        parts = []
        for rank, instance_id in enumerate(ids):
            text = _call(f"logs of instance {instance_id}", instances.logs, client, instance_id)
            if not isinstance(text, str):
                text = json.dumps(text)
            parts.append(
                f"==> instance {instance_id} (node {rank}) <==\n{text}" if len(ids) > 1 else text
            )
        return "\n".join(parts)

    # -- the instances ------------------------------------------------------------------------

    def _check_request(self, request: LaunchRequest) -> None:
        super()._check_request(request)
        if request.nproc_per_node < 1:
            raise UsageError(f"vastai: nproc_per_node must be >= 1, not {request.nproc_per_node}")

    def _plan(self, request: LaunchRequest) -> list[Row]:
        """The offers to rent, one per machine."""
        self._check_request(request)
        offers = self.choose_offers(self._client(), request)
        _warn_multi_machine(request)  # once the key and the offers are good
        return offers

    def _parse_id(self, text: str) -> int:
        return int(text)

    def _create(
        self, request: LaunchRequest, offers: list[Row], rank: int, rdzv: tuple[str, int] | None
    ) -> int:
        offer, create = offers[rank], _api("instances").create_instance_from_payload
        payload = self.create_payload(request, self.script(request, rank, rdzv))
        answer = _call(
            f"create an instance from offer {offer['id']}",
            create,
            self._client(),
            offer["id"],
            payload,
        )
        instance_id = answer.get("new_contract") if isinstance(answer, dict) else None
        if not isinstance(instance_id, int):
            raise VastAIError(f"vastai: offer {offer['id']} was not rented: {answer!r:.200}")
        log.info("vastai instance created", instance=instance_id, offer=offer["id"], node=rank)
        return instance_id

    def _show(self, instance_id: int) -> Row | None:
        show = _api("instances").show_instance
        try:
            row: Row = _call(f"show instance {instance_id}", show, self._client(), instance_id)
        except _GoneError:
            return None
        return row

    def _ready(self, instance_id: int, row: Row, rendezvous: bool) -> bool:
        status = row.get("actual_status")
        if status in ("exited", "offline") or row.get("intended_status") == "stopped":
            message = row.get("status_msg") or status
            raise VastAIError(f"vastai: instance {instance_id} failed to start: {message}")
        return status == "running"

    def _late(self, instance_id: int, row: Row, rendezvous: bool) -> Exception:
        return VastAIError(
            f"vastai: instance {instance_id} was not running after "
            f"{self.options.ready_timeout_s:g}s (last status {str(row.get('actual_status'))!r})"
        )

    def _rendezvous(self, instance_id: int, row: Row) -> tuple[str, int]:
        port = self.options.rdzv_port
        host = row.get("public_ipaddr")
        mapped = ((row.get("ports") or {}).get(f"{port}/tcp") or [{}])[0].get("HostPort")
        if not host or not mapped:
            raise VastAIError(
                f"vastai: instance {instance_id} runs but shows no public address or mapping "
                f"of port {port}/tcp for the rendezvous"
            )
        return str(host).strip(), int(mapped)

    def _delete(self, instance_id: int) -> None:
        destroy = _api("instances").destroy_instance
        with contextlib.suppress(_GoneError):  # gone already
            _call(f"destroy instance {instance_id}", destroy, self._client(), instance_id)

    def _rolled_back(
        self, error: BaseException, created: Sequence[int], left: Mapping[int, str]
    ) -> str:
        done = f"destroyed instance(s) {_ids(created)}" if created else "nothing was created"
        if left:
            done += f"; FAILED to destroy {_ids(left)}: destroy them yourself"
        return f"{error} ({done})"

    def _state(self, instance_id: int) -> JobState:
        row = self._show(instance_id)
        if row is None or row.get("intended_status") == "destroyed":
            return JobState.CANCELLED
        label = str(row.get("label") or "")
        if label.startswith(EXIT_LABEL):
            return exit_state(label.removeprefix(EXIT_LABEL))
        actual = row.get("actual_status")
        if actual == "running":
            return JobState.RUNNING
        if actual in ("exited", "stopped", "offline"):
            return JobState.FAILED  # ended without the script's exit label
        return JobState.PENDING


def _warn_multi_machine(request: LaunchRequest) -> None:
    if request.nnodes > 1:
        log.warning(MULTI_MACHINE_WARNING, nnodes=request.nnodes)


def _ids(ids: Iterable[int]) -> str:
    return ", ".join(str(i) for i in ids)


def _query_text(query: Mapping[str, Any]) -> str:
    return " ".join(
        f"{field}{_OPS[op][0]}{value}"
        for field, cond in query.items()
        for op, value in cond.items()
    )


def _misses(offer: Mapping[str, Any], query: Mapping[str, Any]) -> int:
    """How many of ``query``'s conditions ``offer`` fails (names compared case aside)."""
    misses = 0
    for field, cond in query.items():
        for op, wanted in cond.items():
            value = offer.get(field)
            if isinstance(wanted, str):
                value, wanted = str(value).lower(), wanted.lower()
            try:
                misses += not _OPS[op][1](value, wanted)
            except TypeError:
                misses += 1
    return misses


def _describe(offer: Mapping[str, Any]) -> str:
    return (
        f"#{offer.get('id')} {offer.get('num_gpus')}x {offer.get('gpu_name')} "
        f"{float(offer.get('gpu_ram') or 0) / 1000:.0f} GB, reliability "
        f"{float(offer.get('reliability') or 0):.3f}, ${float(offer.get('dph_total') or 0):.4f}/h"
    )
