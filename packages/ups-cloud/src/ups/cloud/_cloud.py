"""What the cloud launchers share, written once: a job is one instance per machine, each given
its own start-up script (:mod:`ups.cloud._startup`). With several machines the first is created
alone and waited for, and its record tells the others where its rendezvous is. If any step of
a submit fails, every instance created is deleted and the error says which (and which could
not be). The handle is ``NAME:ID1,ID2,...``, the first machine first; it holds no secret.

The API key comes from the environment (``api_key_env``) or from a file the user names
(``api_key_file``), and goes only to the cloud's API: a start-up script that would contain it
is refused, and neither the handle nor a log line holds it.

A cloud's launcher subclasses :class:`CloudLauncher` with its API: check what a submit needs
before it creates anything, create, show and delete an instance, and say when one is ready. The
state of a job its machines ended is :func:`exit_state` of the exit status they report.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import structlog

from ups.core import JobState, LaunchRequest, UsageError, load_config

from ._options import CloudOptions
from ._startup import StartupScript, machine_files, machine_request, node_upload_url

log = structlog.get_logger()

T = TypeVar("T")
Options = TypeVar("Options", bound=CloudOptions)
Id = TypeVar("Id", int, str)
"""An instance's id (VastAI's are numbers, Vultr's strings)."""
Rendezvous = TypeVar("Rendezvous")
"""What the machines after the first take from its record: where its rendezvous is."""
Plan = TypeVar("Plan")
"""What a submit finds before it creates anything, and each create uses (VastAI: the offers)."""
Row = dict[str, Any]
"""An instance's record, as the cloud's API answers it."""


def exit_state(status: str) -> JobState:
    """The state of a job whose start-up script ended with exit ``status`` (its text)."""
    return JobState.SUCCEEDED if status.strip() == "0" else JobState.FAILED


def wait_until(
    look: Callable[[], T],
    ready: Callable[[T], bool],
    *,
    timeout_s: float,
    poll_s: float,
    late: Callable[[T], Exception],
) -> T:
    """``look()`` every ``poll_s`` seconds until what it sees is ``ready``, and return that.

    :raises Exception: what ``look`` or ``ready`` raise; ``late(last seen)`` once
        ``timeout_s`` seconds have passed.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        seen = look()
        if ready(seen):
            return seen
        if time.monotonic() >= deadline:
            raise late(seen)
        time.sleep(poll_s)


class CloudLauncher(ABC, Generic[Options, Id, Rendezvous, Plan]):
    """A launcher whose machines are a cloud's instances (see the module doc)."""

    NAME: ClassVar[str]
    """The launcher's name: the handle's prefix, the start of its messages."""
    ERROR: ClassVar[type[Exception]]
    """What a failure of the cloud's API is raised as (a refused key: :class:`UsageError`)."""
    DELETE: ClassVar[tuple[str, str]] = ("delete", "deleted")
    """The cloud's word for removing an instance, and its past tense."""

    def __init__(self, *, options: Options) -> None:
        self.options = options
        self._key = options.api_key(self.NAME)

    # -- the cloud's API ----------------------------------------------------------------------

    @abstractmethod
    def _parse_id(self, text: str) -> Id:
        """The instance id ``text`` names; :class:`ValueError` if it names none."""

    @abstractmethod
    def _plan(self, request: LaunchRequest) -> Plan:
        """Check ``request``, the key and what the machines need, creating nothing; return
        what :meth:`_create` needs.

        :raises UsageError: naming what is wrong.
        """

    @abstractmethod
    def _create(
        self, request: LaunchRequest, plan: Plan, rank: int, rendezvous: Rendezvous | None
    ) -> Id:
        """Create machine ``rank``'s instance (``rendezvous``: the first one's, for the
        others); raises ``ERROR`` or :class:`UsageError` when it fails."""

    @abstractmethod
    def _show(self, instance: Id) -> Row | None:
        """The instance's record; ``None`` when it does not exist (any more)."""

    @abstractmethod
    def _ready(self, instance: Id, row: Row, rendezvous: bool) -> bool:
        """Whether the instance is ready (and, with ``rendezvous``, shows what the other
        machines need of it); raises when it never will be."""

    @abstractmethod
    def _late(self, instance: Id, row: Row, rendezvous: bool) -> Exception:
        """The error for an instance not ready in time, ``row`` its last record."""

    @abstractmethod
    def _rendezvous(self, instance: Id, row: Row) -> Rendezvous:
        """Where the first machine (``instance``, ready) serves the rendezvous."""

    @abstractmethod
    def _delete(self, instance: Id) -> None:
        """Delete the instance (one gone already is not an error).

        :raises UsageError: the key was refused; ``ERROR``: the API failed.
        """

    @abstractmethod
    def _rolled_back(
        self, error: BaseException, created: Sequence[Id], left: Mapping[Id, str]
    ) -> str:
        """The message of a submit that failed with ``error`` once ``created`` existed, all
        deleted but ``left`` (instance -> why)."""

    # -- written once -------------------------------------------------------------------------

    def submit(self, request: LaunchRequest) -> str:
        """Create machine 0, wait until it is ready, then the others with its rendezvous, and
        wait for them; return the handle.

        :raises UsageError: a bad request, options or key; or ``ERROR``: after deleting every
            instance created, naming them (:meth:`_rolled_back`).
        """
        plan = self._plan(request)
        created: list[Id] = []
        try:
            rendezvous: Rendezvous | None = None
            for rank in range(request.nnodes):
                created.append(self._create(request, plan, rank, rendezvous))
                if rank == 0:
                    several = request.nnodes > 1
                    first = self._wait_ready(created[0], rendezvous=several)
                    rendezvous = self._rendezvous(created[0], first) if several else None
            for instance in created[1:]:
                self._wait_ready(instance)
        except BaseException as error:
            left = self._delete_all(created)
            message = self._rolled_back(error, created, left)
            if isinstance(error, UsageError):
                raise UsageError(message) from error
            if isinstance(error, Exception):
                raise self.ERROR(message) from error
            log.error("submit interrupted", created=created, left=list(left))
            raise
        handle = self._handle(created)
        log.info(f"{self.NAME} job submitted", handle=handle)
        return handle

    def cancel(self, handle: str) -> None:
        """Delete every instance of the job (those already gone are skipped).

        :raises UsageError: a bad handle, or no key to ask with.
        :raises ERROR: naming the instances that could not be deleted.
        """
        instances = self._ids(handle)
        self._key.read()
        left = self._delete_all(instances)
        if left:
            raise self.ERROR(
                f"{self.NAME}: could not {self.DELETE[0]} instance(s) {', '.join(map(str, left))}"
            )

    def _check_request(self, request: LaunchRequest) -> None:
        if request.nnodes < 1:
            raise UsageError(f"{self.NAME}: nnodes must be >= 1, not {request.nnodes}")

    def _handle(self, instances: Sequence[Id]) -> str:
        """The handle of a job of ``instances``, the first machine first."""
        return f"{self.NAME}:" + ",".join(map(str, instances))

    def _ids(self, handle: str) -> list[Id]:
        """The instances of ``handle`` (``NAME:ID1,ID2,...``; the ids alone are taken too)."""
        try:
            return [
                self._parse_id(part) for part in handle.removeprefix(f"{self.NAME}:").split(",")
            ]
        except ValueError:
            raise UsageError(
                f"{self.NAME}: {handle!r} is not a {self.NAME} handle ({self.NAME}:ID1,ID2,...), "
                "so not a handle of this launcher"
            ) from None

    def _script(
        self, request: LaunchRequest, rank: int, rdzv_host: str | None, **cloud: Any
    ) -> str:
        """Machine ``rank``'s start-up script; ``rdzv_host`` (with several machines) is where
        the rendezvous is, ``cloud`` the cloud's own :class:`StartupScript` fields.

        :raises UsageError: it would contain the API key.
        """
        o = self.options
        text = StartupScript(
            request=machine_request(request),
            files=machine_files(request, o.files),
            packages=o.packages,
            data_step=o.data_step,
            node_rank=rank,
            rdzv_host=rdzv_host if request.nnodes > 1 else None,
            network_interface=o.network_interface,
            max_restarts=load_config(request.config, request.overrides).distributed.max_restarts,
            upload_url=node_upload_url(o.upload_url, rank),
            auto_shutdown=o.auto_shutdown,
            **cloud,
        ).render()
        self._key.refuse_in(text, "the start-up script")
        return text

    def _wait_ready(self, instance: Id, *, rendezvous: bool = False) -> Row:
        """The record of ``instance`` once it is ready (see :meth:`_ready`).

        :raises ERROR: it disappeared, will never be ready, or was not within
            ``ready_timeout_s``.
        """

        def look() -> Row:
            row = self._show(instance)
            if row is None:
                raise self.ERROR(f"{self.NAME}: instance {instance} disappeared while starting")
            return row

        return wait_until(
            look,
            lambda row: self._ready(instance, row, rendezvous),
            timeout_s=self.options.ready_timeout_s,
            poll_s=self.options.poll_s,
            late=lambda row: self._late(instance, row, rendezvous),
        )

    def _delete_all(self, instances: Sequence[Id]) -> dict[Id, str]:
        """Delete each instance; return those that could not be, with why (each logged)."""
        left: dict[Id, str] = {}
        verb, past = self.DELETE
        for instance in instances:
            try:
                self._delete(instance)
            except (UsageError, self.ERROR) as error:
                left[instance] = str(error)
                log.warning(
                    f"could not {verb} a {self.NAME} instance", instance=instance, why=str(error)
                )
            else:
                log.info(f"{self.NAME} instance {past}", instance=instance)
        return left
