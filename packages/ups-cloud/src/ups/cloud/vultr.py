"""The ``vultr`` launcher: Vultr cloud GPU instances over the v2 REST API, one per machine.

``submit`` checks the plan and region (``GET /plans``, ``GET /regions``), then creates one
instance per machine (``POST /instances``) with the start-up script of :mod:`ups.cloud.startup`
as its user data (base64; cloud-init runs it once at first boot), and waits until each is
``active``. With several machines every instance joins a VPC (``vpc_id``, or ``enable_vpc``:
the region's default one) and the first is created alone: the others are created once its
private address (``internal_ip``) is known, and their scripts hold it as the rendezvous host.
Each machine's script finds its own address and NIC on the VPC (the one with a private address
beside the public NIC, or the route to the first machine; ``network_interface`` names it
instead) and forms the process group over it (see
:attr:`ups.cloud.startup.StartupScript.network_interface`).
If creating any instance fails, or one is not ready within ``ready_timeout_s``, every instance
created is deleted and the error says so. The handle is ``vultr:ID1,ID2,...`` (first machine
first); it holds no secret.

Vultr has no API for an instance's console output, so:

* ``logs`` reads ``startup.log`` from ``upload_url`` (with fsspec), where the script uploads
  the run folder when training ends; before that (or without ``upload_url``) it says where the
  log is on the machines (``/root/ups/runs/startup.log``, over ssh).
* ``status`` is ``PENDING`` until every instance is active and booted, ``RUNNING`` while any
  runs, and once every machine has stopped (the script's auto-shutdown) and uploaded its run
  folder, ``SUCCEEDED`` or ``FAILED`` from the exit status the first one uploaded
  (``startup.exit``), the machines deleted; ``STOPPED`` when they stopped but a machine's
  upload cannot be read (no ``upload_url``, or it failed) or a delete failed: the machines are
  kept, and billed, until ``cancel``. ``CANCELLED`` when the instances are gone.

A stopped Vultr instance is billed as a running one is, and only a delete ends the bill. The
machines cannot delete themselves (that needs the account's API key, which never goes to a
machine), so ``status`` does it: once every machine has stopped and uploaded its run folder to
``upload_url`` (the exit status, uploaded last, says so), ``status`` deletes them all. Without
``upload_url`` the results live only on the machines' disks, so they are kept, and billed,
until ``cancel`` (``DELETE /instances/ID``); ``submit`` and the dry run say so. ``ups logs
--follow`` asks for the status until the job ends, so following a job that uploads also ends
its bill; a ``STOPPED`` job says that it is still billed.

The API key comes from the environment (``api_key_env``, ``VULTR_API_KEY``) or from a file the
user names (``api_key_file``), and is sent only as the ``Authorization: Bearer`` header: never
written to the start-up script, the dry-run text, the handle or the log. Requests that fail with
429 are retried after ``Retry-After``, and reads and deletes that fail with 5xx with exponential
backoff (urllib3's ``Retry``); a create is not retried after a 5xx, which may have created it.
"""

from __future__ import annotations

import base64
import difflib
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import requests  # type: ignore[import-untyped, unused-ignore]
import structlog
from requests.adapters import HTTPAdapter  # type: ignore[import-untyped, unused-ignore]
from urllib3.util.retry import Retry

from ups.core import LaunchRequest, UsageError, above, load_config

from .options import CloudOptions, check_readable_here
from .startup import (
    EXIT_FILE,
    LOG_FILE,
    StartupScript,
    _as_tuple,
    machine_files,
    machine_request,
    node_upload_url,
)

log = structlog.get_logger()

HANDLE_PREFIX = "vultr:"
DEFAULT_BASE_URL = "https://api.vultr.com/v2"
DEFAULT_OS_ID = 1743
"""Ubuntu 22.04 x64 in Vultr's ``GET /os`` list."""
HOURS_PER_MONTH = 672
"""Vultr bills by the hour up to the monthly price, which is reached after 672 hours."""
FIRST_MACHINE_RDZV_HOST = "127.0.0.1"
"""The rendezvous endpoint's host on the first machine of several (the others: its internal_ip)."""
_REDACTED = "<redacted>"
_RETRY_STATUSES = (429, 500, 502, 503, 504)

State = Literal["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED", "CANCELLED"]


class VultrError(RuntimeError):
    """A request to the Vultr API failed; the message is one line."""


READS_UPLOAD = "reading it here (ups status, ups logs)"
"""Why this process needs to read ``upload_url``, for the message when it cannot."""


@attrs.frozen(kw_only=True)
class VultrLauncherOptions(CloudOptions):
    """Options of the ``vultr`` launcher (and those of :class:`~ups.cloud.options.CloudOptions`:
    ``api_key_file``, ``upload_url``)."""

    plan: str
    """The plan of every machine, e.g. ``vcg-a100-1c-6g-4vram`` (``GET /plans?type=vcg``)."""
    region: str
    """The region, e.g. ``ewr`` (``GET /regions``)."""
    os_id: int | None = None
    """The operating system (``GET /os``); default: Ubuntu 22.04 x64 (1743) unless ``image_id``."""
    image_id: str | None = None
    """A marketplace application image instead of ``os_id``."""
    vpc_id: str | None = None
    """The VPC the machines of a multi-machine job join; default: the region's default VPC."""
    network_interface: str | None = None
    """The NIC (e.g. ``enp8s0``) on which the machines of a multi-machine job reach each other;
    ``None``: each machine finds its VPC NIC at start (the rule:
    :attr:`ups.cloud.startup.StartupScript.network_interface`)."""
    api_key_env: str = "VULTR_API_KEY"
    """The environment variable that holds the API key."""
    base_url: str = DEFAULT_BASE_URL
    """The API's root URL."""
    ready_timeout_s: float = attrs.field(default=900.0, validator=above(0))
    """How long ``submit`` waits for each instance to become active before deleting them all."""
    poll_s: float = attrs.field(default=5.0, validator=above(0))
    """Seconds between two looks at a pending instance."""
    request_timeout_s: float = attrs.field(default=30.0, validator=above(0))
    retries: int = 5
    """How often a request that fails with 429 or (not a create) 5xx is tried again."""
    backoff_s: float = 1.0
    """urllib3's backoff factor for 5xx retries: 0, 2x, 4x, ... seconds (429 waits ``Retry-After``)."""
    auto_shutdown: bool = True
    """Shut each machine down when its script ends. A stopped instance still bills: ``status``
    deletes the machines once they have uploaded to ``upload_url`` (else ``cancel`` does)."""
    packages: Mapping[str, str] | None = None
    """Distributions the script installs on each machine, name -> exact version."""
    python: str = "python3"
    """The Python on the machine that installs, trains and uploads."""
    data_step: str | None = None
    """A shell command run on each machine before training."""
    nproc_per_node: int | Literal["gpu"] | None = "gpu"
    """Processes per machine: a number, ``"gpu"`` (one per GPU) or ``None`` (the request's)."""
    files: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    """Further files the run needs (e.g. a model module), as paths relative to the working
    directory: read at launch and written on each machine at the same relative path, beside
    the config (see :func:`ups.cloud.startup.machine_files`)."""
    label_prefix: str = "ups"
    """Instances are labelled ``<label_prefix>-<run name>-<machine rank>``."""

    def __attrs_post_init__(self) -> None:
        if self.os_id is not None and self.image_id is not None:
            raise ValueError("give os_id or image_id, not both")


@attrs.frozen
class _Call:
    """A request as the dry-run shows it."""

    method: str
    path: str
    body: Mapping[str, Any] | None = None
    note: str = ""


class _Retry(Retry):
    """urllib3's ``Retry``, but a create (POST) is only tried again after 429, which Vultr
    answers before doing anything; a 5xx may come after the instance was made."""

    def is_retry(self, method: str, status_code: int, has_retry_after: bool = False) -> bool:
        if method.upper() == "POST":
            return status_code == 429 and bool(self.total)
        return super().is_retry(method, status_code, has_retry_after)


class VultrLauncher:
    """Runs configs on Vultr instances (see the module doc)."""

    def __init__(self, *, options: VultrLauncherOptions) -> None:
        self.options = options
        self.base_url = options.base_url.rstrip("/")
        self._session: requests.Session | None = None
        self._key = options.api_key("vultr")

    # -- the Launcher protocol ----------------------------------------------------------------

    def dry_run(self, request: LaunchRequest) -> str:
        """Every request :meth:`submit` would send (user data decoded, the key redacted) and
        the hourly cost, from ``GET /plans`` (read-only: nothing is created)."""
        name = self._run_name(request)
        check_readable_here(self.options.upload_url, READS_UPLOAD)
        plan = self._check_plan_region()
        o = self.options
        calls = [_Call("GET", "/plans"), _Call("GET", "/regions")]
        for rank in range(request.nnodes):
            host = "<internal_ip of machine 0>" if request.nnodes > 1 else None  # not known yet
            body = self._create_body(request, name, rank, host)
            note = ""
            if rank == 0 and request.nnodes > 1:
                note = "then GET /instances/ID until it is active and has its internal_ip"
            calls.append(_Call("POST", "/instances", body, note))
        calls.append(_Call("GET", "/instances/ID", note="each, until active"))
        lines = [
            f"# vultr: {request.nnodes} x {o.plan} in {o.region} for run {name!r}",
            f"# base URL {self.base_url}; header Authorization: Bearer {_REDACTED} (from {self._key.source})",
        ]
        lines += self._cost_lines(plan, request.nnodes)
        for call in calls:
            lines.append("")
            lines.append(f"{call.method} {self.base_url}{call.path}")
            if call.note:
                lines.append(f"# {call.note}")
            if call.body is not None:
                body = dict(call.body)
                script = base64.b64decode(body["user_data"]).decode()
                body["user_data"] = f"<base64 of the start-up script below, {len(script)} bytes>"
                lines.append(json.dumps(body, indent=2))
                lines.append("# user_data, decoded:")
                lines.append(script.rstrip("\n"))
        text = "\n".join(lines) + "\n"
        self._key.refuse_in(text, "the dry-run text")
        return text

    def submit(self, request: LaunchRequest) -> str:
        """Create the instances and wait until they are active; return ``vultr:ID1,...``.

        :raises UsageError: a bad request, config, plan or region, a missing or refused key.
        :raises VultrError: the API failed, or an instance was not ready in time; every
            instance created has then been deleted (or the message names those left).
        """
        name = self._run_name(request)
        # A missing key, or a missing package to read upload_url with, fails before anything
        # is created.
        check_readable_here(self.options.upload_url, READS_UPLOAD)
        self._key.read()
        self._check_plan_region()
        created: list[str] = []
        try:
            first = self._create(request, name, 0, None, created)
            host: str | None = None
            if request.nnodes > 1:
                instance = self._wait_ready(first, need_private_ip=True)
                host = str(instance["internal_ip"])
            for rank in range(1, request.nnodes):
                self._create(request, name, rank, host, created)
            for instance_id in created:
                self._wait_ready(instance_id)
        except BaseException as error:
            raise self._rolled_back(error, created, request.nnodes) from error
        handle = HANDLE_PREFIX + ",".join(created)
        log.info("vultr job submitted", run=name, handle=handle, billing=self._billing_note())
        return handle

    def status(self, handle: str) -> State:
        """See the module doc."""
        ids = self._ids(handle)
        instances = [self._instance(i) for i in ids]
        if all(i is None for i in instances):
            return _ended(self._read_upload(EXIT_FILE), otherwise="CANCELLED")
        if any(i is None for i in instances):
            return "FAILED"  # some machines deleted under a running job
        if any(i["status"] != "active" for i in instances if i is not None):
            return "PENDING"
        if any(i is not None and i.get("power_status") != "stopped" for i in instances):
            # The job has ended only once every machine has (each uploads, then stops).
            if any(i.get("server_status") != "ok" for i in instances if i is not None):
                return "PENDING"
            return "RUNNING"
        if not self._uploaded(len(ids)):
            # Some results are only on the machines' disks: they are kept, and billed.
            log.warning(
                "stopped Vultr instances are still billed; cancel the job to delete them once "
                "their results are copied (with upload_url, status deletes them itself)"
            )
            return "STOPPED"
        # Every machine has ended and uploaded its run folder (the exit status goes last):
        # nothing on them is needed any more, and a stopped Vultr instance bills as a running
        # one does.
        left = self._delete_all(ids)
        if left:
            log.warning("could not delete finished Vultr instances", left=left)
            return "STOPPED"
        log.info("the job ended; its machines were deleted", handle=handle)
        return _ended(self._read_upload(EXIT_FILE), otherwise="STOPPED")

    def logs(self, handle: str) -> str:
        """The first machine's ``startup.log`` from ``upload_url`` once uploaded; until then,
        where the logs are (Vultr keeps no console output)."""
        ids = self._ids(handle)
        text = self._read_upload(LOG_FILE)
        if text is not None:
            return text
        where = f"/root/ups/runs/{LOG_FILE}"
        hosts = []
        for instance_id in ids:
            instance = self._instance(instance_id)
            hosts.append(f"{instance_id} ({instance['main_ip'] if instance else 'deleted'})")
        upload = (
            f"it is uploaded to {self.options.upload_url}/{LOG_FILE} when the job ends"
            if self.options.upload_url
            else "set upload_url to have it uploaded when the job ends"
        )
        return (
            f"Vultr keeps no console output: the log is {where} on each machine "
            f"(ssh root@IP): {', '.join(hosts)}; {upload}.\n"
        )

    def cancel(self, handle: str) -> None:
        """Delete every instance of the job (``DELETE /instances/ID``); gone ones are skipped."""
        left = self._delete_all(self._ids(handle))
        if left:
            raise VultrError(f"could not delete Vultr instance(s) {'; '.join(left)}")

    # -- requests -----------------------------------------------------------------------------

    def _http(self) -> requests.Session:
        if self._session is None:
            o = self.options
            retry = _Retry(
                total=o.retries,
                connect=o.retries,
                read=o.retries,
                status=o.retries,
                backoff_factor=o.backoff_s,
                status_forcelist=_RETRY_STATUSES,
                respect_retry_after_header=True,
                raise_on_status=False,
            )
            session = requests.Session()
            adapter = HTTPAdapter(max_retries=retry)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
            self._session = session
        return self._session

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        auth: bool = True,
        ok_missing: bool = False,
    ) -> dict[str, Any] | None:
        headers = {"Accept": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {self._key.read()}"
        what = f"{method} {path}"
        try:
            response = self._http().request(
                method,
                self.base_url + path,
                json=body,
                params=params,
                headers=headers,
                timeout=self.options.request_timeout_s,
            )
        except requests.RequestException as error:
            raise VultrError(f"Vultr API {what}: {type(error).__name__}: {error}") from None
        if ok_missing and response.status_code == 404:
            return None
        if response.status_code in (401, 403):
            raise UsageError(
                f"Vultr API {what}: {response.status_code} {response.reason}: the API key from "
                f"{self._key.source} was refused (is it valid, and is this machine's IP allowed?)"
            )
        if response.status_code >= 400:
            raise VultrError(
                f"Vultr API {what}: {response.status_code} {response.reason}"
                + (
                    f" after {self.options.retries} retries"
                    if response.status_code in _RETRY_STATUSES
                    else ""
                )
                + f": {_error_text(response)}"
            )
        if response.status_code == 204 or not response.content:
            return {}
        try:
            data = response.json()
        except ValueError:
            raise VultrError(f"Vultr API {what}: the answer is not JSON") from None
        if not isinstance(data, dict):
            raise VultrError(f"Vultr API {what}: unexpected answer {str(data)[:200]!r}")
        return data

    def _list(self, path: str, key: str, params: Mapping[str, Any] | None = None) -> list[Any]:
        """Every item of a paginated list (``meta.links.next`` is the next cursor)."""
        items: list[Any] = []
        query = {**(params or {}), "per_page": 500}
        for _ in range(100):
            data = self._call("GET", path, params=query, auth=False) or {}
            items += data.get(key) or []
            cursor = ((data.get("meta") or {}).get("links") or {}).get("next") or ""
            if not cursor:
                return items
            query["cursor"] = cursor
        return items

    def _instance(self, instance_id: str) -> dict[str, Any] | None:
        data = self._call("GET", f"/instances/{instance_id}", ok_missing=True)
        if data is None:
            return None
        instance = data.get("instance")
        if not isinstance(instance, dict):
            raise VultrError(f"Vultr API GET /instances/{instance_id}: no instance in the answer")
        return instance

    # -- submit's steps -----------------------------------------------------------------------

    def _run_name(self, request: LaunchRequest) -> str:
        if request.nnodes < 1:
            raise UsageError(f"nnodes must be >= 1, not {request.nnodes}")
        return load_config(request.config, request.overrides).run.name

    def _check_plan_region(self) -> dict[str, Any]:
        """The plan's record; a plan or region Vultr does not have, or a plan the region does
        not offer, is a :class:`UsageError` naming the nearest ones."""
        o = self.options
        plans = {str(p.get("id")): p for p in self._list("/plans", "plans")}
        regions = {str(r.get("id")) for r in self._list("/regions", "regions")}
        if o.region not in regions:
            raise UsageError(
                f"vultr: unknown region {o.region!r}; {_nearest(o.region, sorted(regions))}"
            )
        plan = plans.get(o.plan)
        if plan is None:
            gpu = sorted(p for p, v in plans.items() if _is_gpu(p, v))
            here = [p for p in gpu if o.region in (plans[p].get("locations") or [])]
            raise UsageError(
                f"vultr: unknown plan {o.plan!r}; {_nearest(o.plan, gpu)}"
                + (f"; GPU plans in {o.region}: {', '.join(here[:12])}" if here else "")
            )
        locations = [str(x) for x in plan.get("locations") or []]
        if o.region not in locations:
            raise UsageError(
                f"vultr: plan {o.plan!r} is not offered in region {o.region!r}; it is in: "
                + (", ".join(sorted(locations)) or "no region now")
            )
        return dict(plan)

    def _cost_lines(self, plan: Mapping[str, Any], nnodes: int) -> list[str]:
        hourly = plan.get("hourly_cost")
        monthly = plan.get("monthly_cost")
        if isinstance(hourly, (int, float)) and hourly > 0:
            each, how = float(hourly), "hourly_cost"
        elif isinstance(monthly, (int, float)) and monthly > 0:
            each, how = (
                float(monthly) / HOURS_PER_MONTH,
                f"monthly_cost {monthly} / {HOURS_PER_MONTH} h",
            )
        else:
            return ["# cost: no price in GET /plans"]
        return [
            f"# cost: about ${each * nnodes:.3f}/hour for {nnodes} machine(s) "
            f"(${each:.3f}/hour each, from {how}); stopped instances bill until deleted: "
            + self._billing_note()
        ]

    def _billing_note(self) -> str:
        if self.options.upload_url is None:
            return "without upload_url they are kept for their results until `ups cancel`"
        return "`ups status` deletes them once they have stopped and uploaded their results"

    def _script(self, request: LaunchRequest, name: str, rank: int, host: str | None) -> str:
        o = self.options
        script = StartupScript(
            request=machine_request(request),
            files=machine_files(request, o.files),
            python=o.python,
            packages=o.packages,
            data_step=o.data_step,
            nproc_per_node=o.nproc_per_node,
            node_rank=rank,
            # The first machine serves the rendezvous itself: torch takes a loopback endpoint
            # for its own, and the store listens on every interface (the VPC's included);
            # the script finds each machine's VPC address for the process group.
            rdzv_host=(FIRST_MACHINE_RDZV_HOST if rank == 0 else host)
            if request.nnodes > 1
            else None,
            rdzv_id=f"{o.label_prefix}-{name}",
            network_interface=o.network_interface,
            max_restarts=load_config(request.config, request.overrides).distributed.max_restarts,
            upload_url=node_upload_url(o.upload_url, rank),
            auto_shutdown=o.auto_shutdown,
        ).render()
        self._key.refuse_in(script, "the start-up script")
        return script

    def _create_body(
        self, request: LaunchRequest, name: str, rank: int, host: str | None
    ) -> dict[str, Any]:
        o = self.options
        body: dict[str, Any] = {
            "region": o.region,
            "plan": o.plan,
            "label": f"{o.label_prefix}-{name}-{rank}",
            "tags": [o.label_prefix],
            "user_data": base64.b64encode(
                self._script(request, name, rank, host).encode()
            ).decode(),
            "activation_email": False,
        }
        if o.image_id is not None:
            body["image_id"] = o.image_id
        else:
            body["os_id"] = o.os_id if o.os_id is not None else DEFAULT_OS_ID
        if request.nnodes > 1:
            if o.vpc_id is not None:
                body["attach_vpc"] = [o.vpc_id]
            else:
                body["enable_vpc"] = True
        return body

    def _create(
        self, request: LaunchRequest, name: str, rank: int, host: str | None, created: list[str]
    ) -> str:
        body = self._create_body(request, name, rank, host)
        try:
            data = self._call("POST", "/instances", body=body) or {}
        except (VultrError, UsageError) as error:
            raise type(error)(
                f"creating machine {rank + 1} of {request.nnodes} failed: {error}"
            ) from None
        instance_id = str((data.get("instance") or {}).get("id") or "")
        if not instance_id:
            raise VultrError("Vultr API POST /instances: no instance id in the answer")
        created.append(instance_id)
        log.info("vultr instance created", id=instance_id, rank=rank, label=body["label"])
        return instance_id

    def _wait_ready(self, instance_id: str, *, need_private_ip: bool = False) -> dict[str, Any]:
        deadline = time.monotonic() + self.options.ready_timeout_s
        while True:
            instance = self._instance(instance_id)
            if instance is None:
                raise VultrError(f"Vultr instance {instance_id} disappeared while starting")
            ready = instance.get("status") == "active"
            if need_private_ip:
                ready = ready and bool(instance.get("internal_ip"))
            if ready:
                return instance
            if time.monotonic() >= deadline:
                raise VultrError(
                    f"Vultr instance {instance_id} was not ready within "
                    f"{self.options.ready_timeout_s:g} s (status {instance.get('status')}, "
                    f"server_status {instance.get('server_status')}"
                    + (", no internal_ip" if need_private_ip else "")
                    + ")"
                )
            time.sleep(self.options.poll_s)

    def _delete_all(self, ids: Sequence[str]) -> list[str]:
        """Delete each instance; the ones that could not be, with why."""
        left = []
        for instance_id in ids:
            try:
                self._call("DELETE", f"/instances/{instance_id}", ok_missing=True)
                log.info("vultr instance deleted", id=instance_id)
            except (VultrError, UsageError) as error:
                left.append(f"{instance_id} ({error})")
        return left

    def _rolled_back(self, error: BaseException, created: list[str], nnodes: int) -> BaseException:
        if not created:
            return error
        left = self._delete_all(created)
        deleted = [i for i in created if not any(x.startswith(i + " ") for x in left)]
        message = f"{error}; deleted the {len(deleted)} instance(s) created: {', '.join(deleted) or 'none'}"
        if left:
            message += f"; COULD NOT DELETE (still billing, delete them in the Vultr console): {'; '.join(left)}"
        if isinstance(error, UsageError):
            return UsageError(message)
        if isinstance(error, Exception):
            return VultrError(message)
        log.error("submit interrupted", deleted=deleted, left=left)
        return error

    # -- helpers ------------------------------------------------------------------------------

    def _ids(self, handle: str) -> list[str]:
        ids = handle[len(HANDLE_PREFIX) :].split(",") if handle.startswith(HANDLE_PREFIX) else []
        if not ids or not all(i and i.replace("-", "").isalnum() for i in ids):
            raise UsageError(f"{handle!r} is not a vultr handle (vultr:ID1,ID2,...)")
        return ids

    def _uploaded(self, nnodes: int) -> bool:
        """Whether every machine's run folder is uploaded: its exit status, which the upload
        writes last, is at ``upload_url`` (``nodes/R/`` for machine R > 0)."""
        return all(
            self._read_upload(EXIT_FILE if rank == 0 else f"nodes/{rank}/{EXIT_FILE}") is not None
            for rank in range(nnodes)
        )

    def _read_upload(self, name: str) -> str | None:
        url = self.options.upload_url
        if url is None:
            return None
        check_readable_here(url, READS_UPLOAD)
        import fsspec  # type: ignore[import-untyped, unused-ignore]

        try:
            with fsspec.open(f"{url.rstrip('/')}/{name}", "r") as file:
                return str(file.read())
        except FileNotFoundError:
            return None


def _ended(exit_status: str | None, *, otherwise: State) -> State:
    """The state of an ended job from the exit status it uploaded (``otherwise`` without one)."""
    if exit_status is None:
        return otherwise
    return "SUCCEEDED" if exit_status.strip() == "0" else "FAILED"


def _is_gpu(plan_id: str, plan: Mapping[str, Any]) -> bool:
    return plan_id.startswith("vcg") or plan.get("type") == "vcg" or bool(plan.get("gpu_type"))


def _nearest(name: str, known: Sequence[str]) -> str:
    near = difflib.get_close_matches(name, known, n=5, cutoff=0.4)
    if near:
        return "nearest: " + ", ".join(near)
    return "known: " + (", ".join(known[:12]) or "none") + (" ..." if len(known) > 12 else "")


def _error_text(response: requests.Response) -> str:
    try:
        data = response.json()
        if isinstance(data, dict) and data.get("error"):
            return str(data["error"]).replace("\n", " ")[:300]
    except ValueError:
        pass
    return response.text.replace("\n", " ")[:300] or "(no details)"
