"""The ``vultr`` launcher: Vultr cloud GPU instances over the v2 REST API, one per machine.

``submit`` checks the plan and region (``GET /plans``, ``GET /regions``), then creates the
instances (``POST /instances``; :mod:`ups.cloud._cloud`), each with its start-up script as its
user data (base64; cloud-init runs it once at first boot), and waits until each is ``active``.
With several machines every instance joins a VPC (``vpc_id``, or ``enable_vpc``: the region's
default one), and the first one's private address (``internal_ip``) is the others' rendezvous
host. Requests go through :class:`ups.cloud._rest.RestApi` (the key only as a Bearer header).

Vultr has no API for an instance's console output, so ``logs`` reads ``startup.log`` from
``upload_url`` once uploaded (:mod:`ups.cloud._uploads`), and until then says where it is on the
machines (``/root/ups/runs/startup.log``, over ssh).

``status`` is ``PENDING`` until every instance is active and booted, ``RUNNING`` while any runs.
A stopped Vultr instance bills as a running one does, and only a delete ends the bill, which
the machines cannot do (that needs the account's key, which never goes to a machine). So once
every machine has stopped (the script's auto-shutdown) and uploaded its run folder, ``status``
deletes them and is ``SUCCEEDED`` or ``FAILED`` from the exit status the first one uploaded;
``STOPPED`` when they stopped but a machine's upload cannot be read (no ``upload_url``, or it
failed) or a delete failed: the machines are kept, and billed, until ``cancel`` (``submit`` and
the dry run say so). ``CANCELLED`` when the instances are gone.
"""

from __future__ import annotations

import base64
import difflib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import structlog

from ups.core import JobState, LaunchRequest, UsageError, at_least, load_config

from ._cloud import CloudLauncher, Row, exit_state
from ._options import CloudOptions, check_readable_here, seconds
from ._rest import RestApi
from ._startup import EXIT_FILE, LOG_FILE
from ._uploads import READS_UPLOAD, read_upload, uploaded

log = structlog.get_logger()

DEFAULT_BASE_URL = "https://api.vultr.com/v2"
DEFAULT_OS_ID = 1743
"""Ubuntu 22.04 x64 in Vultr's ``GET /os`` list."""
HOURS_PER_MONTH = 672
"""Vultr bills by the hour up to the monthly price, which is reached after 672 hours."""
FIRST_MACHINE_RDZV_HOST = "127.0.0.1"
"""The rendezvous endpoint's host on the first machine of several (the others: its internal_ip)."""


class VultrError(RuntimeError):
    """A request to the Vultr API failed; the message is one line."""


@attrs.frozen(kw_only=True)
class VultrLauncherOptions(CloudOptions):
    """Options of the ``vultr`` launcher (and those of :class:`~ups.cloud.CloudOptions`:
    ``api_key_file``, ``upload_url``, ``packages``, ``files``, ...)."""

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
    api_key_env: str = "VULTR_API_KEY"
    url: str = DEFAULT_BASE_URL
    base_url: str | None = None
    """The former name of ``url``, still read."""
    request_timeout_s: float = seconds(30.0)
    retries: int = attrs.field(default=5, validator=at_least(0))
    """How often a request that fails with 429 or (not a create) 5xx is tried again."""
    backoff_s: float = attrs.field(default=1.0, validator=at_least(0))
    """urllib3's backoff factor for 5xx retries: 0, 2x, 4x, ... seconds (429 waits ``Retry-After``)."""
    python: str = "python3"
    """The Python on the machine that installs, trains and uploads."""
    nproc_per_node: int | Literal["gpu"] | None = "gpu"
    """Processes per machine: a number, ``"gpu"`` (one per GPU) or ``None`` (the request's)."""
    label_prefix: str = "ups"
    """Instances are labelled ``<label_prefix>-<run name>-<machine rank>``."""

    def __attrs_post_init__(self) -> None:
        if self.os_id is not None and self.image_id is not None:
            raise ValueError("give os_id or image_id, not both")
        if self.base_url is not None:
            if self.url != DEFAULT_BASE_URL:
                raise ValueError("give url or base_url (its former name), not both")
            object.__setattr__(self, "url", self.base_url)
            object.__setattr__(self, "base_url", None)


class VultrLauncher(CloudLauncher[VultrLauncherOptions, str, str, str]):
    """Runs configs on Vultr instances (see the module doc)."""

    NAME = "vultr"
    ERROR = VultrError

    def __init__(self, *, options: VultrLauncherOptions) -> None:
        super().__init__(options=options)
        self.base_url = options.url.rstrip("/")
        o = options
        self._api = RestApi(
            "Vultr API", self.base_url, self._key, VultrError,
            o.request_timeout_s, o.retries, o.backoff_s,
        )  # fmt: skip

    # -- the Launcher protocol ----------------------------------------------------------------

    def dry_run(self, request: LaunchRequest) -> str:
        """Every request :meth:`submit` would send (user data decoded, the key redacted) and
        the hourly cost, from ``GET /plans`` (read-only: nothing is created)."""
        name = self._run_name(request)
        check_readable_here(self.options.upload_url, READS_UPLOAD)
        plan = self._check_plan_region()
        o, url = self.options, self.base_url
        lines = [
            f"# vultr: {request.nnodes} x {o.plan} in {o.region} for run {name!r}",
            f"# base URL {url}; header Authorization: Bearer <redacted> (from {self._key.source})",
            *self._cost_lines(plan, request.nnodes),
            *("", f"GET {url}/plans", "", f"GET {url}/regions"),
        ]
        host = "<internal_ip of machine 0>" if request.nnodes > 1 else None  # not known yet
        for rank in range(request.nnodes):
            body = self._create_body(request, name, rank, host)
            script = base64.b64decode(body["user_data"]).decode()
            body["user_data"] = f"<base64 of the start-up script below, {len(script)} bytes>"
            lines += ["", f"POST {url}/instances"]
            if rank == 0 and request.nnodes > 1:
                lines.append("# then GET /instances/ID until it is active and has its internal_ip")
            lines += [json.dumps(body, indent=2), "# user_data, decoded:", script.rstrip("\n")]
        lines += ["", f"GET {url}/instances/ID", "# each, until active"]
        text = "\n".join(lines) + "\n"
        self._key.refuse_in(text, "the dry-run text")
        return text

    def submit(self, request: LaunchRequest) -> str:
        """Create the instances and wait until they are active; return ``vultr:ID1,...`` (see
        :meth:`ups.cloud._cloud.CloudLauncher.submit`); say how they bill."""
        handle = super().submit(request)
        log.info("vultr instances bill until deleted", handle=handle, billing=self._billing_note())
        return handle

    def status(self, handle: str) -> JobState:
        """See the module doc."""
        ids = self._ids(handle)
        instances = [self._show(i) for i in ids]
        if all(i is None for i in instances):
            return self._ended(otherwise=JobState.CANCELLED)
        if any(i is None for i in instances):
            return JobState.FAILED  # some machines deleted under a running job
        if any(i["status"] != "active" for i in instances if i is not None):
            return JobState.PENDING
        if any(i is not None and i.get("power_status") != "stopped" for i in instances):
            # The job has ended only once every machine has (each uploads, then stops).
            if any(i.get("server_status") != "ok" for i in instances if i is not None):
                return JobState.PENDING
            return JobState.RUNNING
        if not uploaded(self.options.upload_url, len(ids)):
            # Some results are only on the machines' disks: they are kept, and billed.
            log.warning(
                "stopped Vultr instances are still billed; cancel the job to delete them once "
                "their results are copied (with upload_url, status deletes them itself)"
            )
            return JobState.STOPPED
        # Every machine has ended and uploaded its run folder (the exit status goes last):
        # nothing on them is needed any more, and a stopped Vultr instance bills as a running
        # one does.
        if self._delete_all(ids):
            return JobState.STOPPED
        log.info("the job ended; its machines were deleted", handle=handle)
        return self._ended(otherwise=JobState.STOPPED)

    def _ended(self, *, otherwise: JobState) -> JobState:
        """The state of the ended job from the exit status the first machine uploaded."""
        status = read_upload(self.options.upload_url, EXIT_FILE)
        return otherwise if status is None else exit_state(status)

    def logs(self, handle: str) -> str:
        """The first machine's ``startup.log`` from ``upload_url`` once uploaded; until then,
        where the logs are (Vultr keeps no console output)."""
        ids = self._ids(handle)
        text = read_upload(self.options.upload_url, LOG_FILE)
        if text is not None:
            return text
        hosts = []
        for instance_id in ids:
            instance = self._show(instance_id)
            hosts.append(f"{instance_id} ({instance['main_ip'] if instance else 'deleted'})")
        upload = (
            f"it is uploaded to {self.options.upload_url}/{LOG_FILE} when the job ends"
            if self.options.upload_url
            else "set upload_url to have it uploaded when the job ends"
        )
        return (
            f"Vultr keeps no console output: the log is /root/ups/runs/{LOG_FILE} on each "
            f"machine (ssh root@IP): {', '.join(hosts)}; {upload}.\n"
        )

    # -- the API ------------------------------------------------------------------------------

    def _list(self, path: str, key: str) -> list[Any]:
        """Every item of a paginated list (``meta.links.next`` is the next cursor)."""
        items: list[Any] = []
        query: dict[str, Any] = {"per_page": 500}
        for _ in range(100):
            data = self._api.call("GET", path, params=query, auth=False) or {}
            items += data.get(key) or []
            query["cursor"] = ((data.get("meta") or {}).get("links") or {}).get("next") or ""
            if not query["cursor"]:
                break
        return items

    def _parse_id(self, text: str) -> str:
        if not (text and text.replace("-", "").isalnum()):
            raise ValueError(text)
        return text

    def _show(self, instance_id: str) -> Row | None:
        data = self._api.call("GET", f"/instances/{instance_id}", ok_missing=True)
        if data is None:
            return None
        instance = data.get("instance")
        if not isinstance(instance, dict):
            raise VultrError(f"Vultr API GET /instances/{instance_id}: no instance in the answer")
        return instance

    def _plan(self, request: LaunchRequest) -> str:
        """The run's name, once the request, plan, region and key are good and ``upload_url``
        can be read here."""
        name = self._run_name(request)
        check_readable_here(self.options.upload_url, READS_UPLOAD)
        self._key.read()
        self._check_plan_region()
        return name

    def _run_name(self, request: LaunchRequest) -> str:
        self._check_request(request)
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
        hourly, monthly = plan.get("hourly_cost"), plan.get("monthly_cost")
        if isinstance(hourly, (int, float)) and hourly > 0:
            each, how = float(hourly), "hourly_cost"
        elif isinstance(monthly, (int, float)) and monthly > 0:
            each = float(monthly) / HOURS_PER_MONTH
            how = f"monthly_cost {monthly} / {HOURS_PER_MONTH} h"
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

    def _create_body(
        self, request: LaunchRequest, name: str, rank: int, host: str | None
    ) -> dict[str, Any]:
        o = self.options
        # The first machine serves the rendezvous itself: torch takes a loopback endpoint for
        # its own, and the store listens on every interface (the VPC's included); the script
        # finds each machine's VPC address for the process group.
        script = self._script(
            request,
            rank,
            FIRST_MACHINE_RDZV_HOST if rank == 0 else host,
            python=o.python,
            nproc_per_node=o.nproc_per_node,
            rdzv_id=f"{o.label_prefix}-{name}",
        )
        body: dict[str, Any] = {
            "region": o.region,
            "plan": o.plan,
            "label": f"{o.label_prefix}-{name}-{rank}",
            "tags": [o.label_prefix],
            "user_data": base64.b64encode(script.encode()).decode(),
            "activation_email": False,
        }
        if o.image_id is not None:
            body["image_id"] = o.image_id
        else:
            body["os_id"] = o.os_id if o.os_id is not None else DEFAULT_OS_ID
        if request.nnodes > 1 and o.vpc_id is not None:
            body["attach_vpc"] = [o.vpc_id]
        elif request.nnodes > 1:
            body["enable_vpc"] = True
        return body

    def _create(self, request: LaunchRequest, name: str, rank: int, host: str | None) -> str:
        body = self._create_body(request, name, rank, host)
        try:
            data = self._api.call("POST", "/instances", body=body) or {}
        except (VultrError, UsageError) as error:
            raise type(error)(
                f"creating machine {rank + 1} of {request.nnodes} failed: {error}"
            ) from None
        instance_id = str((data.get("instance") or {}).get("id") or "")
        if not instance_id:
            raise VultrError("Vultr API POST /instances: no instance id in the answer")
        log.info("vultr instance created", instance=instance_id, rank=rank, label=body["label"])
        return instance_id

    def _ready(self, instance_id: str, row: Row, rendezvous: bool) -> bool:
        return row.get("status") == "active" and (bool(row.get("internal_ip")) or not rendezvous)

    def _late(self, instance_id: str, row: Row, rendezvous: bool) -> Exception:
        return VultrError(
            f"Vultr instance {instance_id} was not ready within "
            f"{self.options.ready_timeout_s:g} s (status {row.get('status')}, "
            f"server_status {row.get('server_status')}"
            + (", no internal_ip" if rendezvous else "")
            + ")"
        )

    def _rendezvous(self, instance_id: str, row: Row) -> str:
        return str(row["internal_ip"])

    def _delete(self, instance_id: str) -> None:
        self._api.call("DELETE", f"/instances/{instance_id}", ok_missing=True)

    def _rolled_back(
        self, error: BaseException, created: Sequence[str], left: Mapping[str, str]
    ) -> str:
        if not created:
            return str(error)
        deleted = [i for i in created if i not in left]
        message = f"{error}; deleted the {len(deleted)} instance(s) created: {', '.join(deleted) or 'none'}"
        if left:
            message += "; COULD NOT DELETE (still billing, delete them in the Vultr console): "
            message += "; ".join(f"{i} ({why})" for i, why in left.items())
        return message


def _is_gpu(plan_id: str, plan: Mapping[str, Any]) -> bool:
    return plan_id.startswith("vcg") or plan.get("type") == "vcg" or bool(plan.get("gpu_type"))


def _nearest(name: str, known: Sequence[str]) -> str:
    near = difflib.get_close_matches(name, known, n=5, cutoff=0.4)
    if near:
        return "nearest: " + ", ".join(near)
    return "known: " + (", ".join(known[:12]) or "none") + (" ..." if len(known) > 12 else "")
