"""A loopback stand-in for the Vultr API v2 endpoints the ``vultr`` launcher uses.

``GET /plans``, ``GET /regions`` (lists with ``meta.total`` and ``meta.links.next`` cursors),
``POST /instances`` (202, ``{"instance": {...}}``), ``GET /instances/{id}``,
``DELETE /instances/{id}`` (204); errors as ``{"error": "...", "status": N}``, shapes as in
Vultr's API v2 reference. State is in memory; faults are set on the server's attributes.
"""

from __future__ import annotations

import itertools
import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

KEY = "vultr-test-key-PLANTED-7f3a9c"

PLANS = [
    {
        "id": "vc2-1c-1gb",
        "vcpu_count": 1,
        "ram": 1024,
        "disk": 25,
        "disk_count": 1,
        "bandwidth": 1024,
        "monthly_cost": 5,
        "type": "vc2",
        "locations": ["ewr", "ams"],
    },
    {
        "id": "vcg-a100-1c-6g-4vram",
        "vcpu_count": 1,
        "ram": 6144,
        "disk": 70,
        "disk_count": 1,
        "bandwidth": 1024,
        "monthly_cost": 90,
        "type": "vcg",
        "locations": ["ewr", "ord"],
        "gpu_vram_gb": 4,
        "gpu_type": "NVIDIA_A100",
    },
    {
        "id": "vcg-a100-12c-120g-80vram",
        "vcpu_count": 12,
        "ram": 122880,
        "disk": 1400,
        "disk_count": 1,
        "bandwidth": 10240,
        "monthly_cost": 1750,
        "type": "vcg",
        "locations": ["ewr"],
        "gpu_vram_gb": 80,
        "gpu_type": "NVIDIA_A100",
    },
]
REGIONS = [
    {"id": "ams", "city": "Amsterdam", "country": "NL", "continent": "Europe", "options": []},
    {
        "id": "ewr",
        "city": "New Jersey",
        "country": "US",
        "continent": "North America",
        "options": [],
    },
    {"id": "ord", "city": "Chicago", "country": "US", "continent": "North America", "options": []},
]


class VultrServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.instances: dict[str, dict[str, Any]] = {}
        self.deleted: list[str] = []
        self.requests: list[dict[str, Any]] = []
        """Every request: method, path, query, headers, body (parsed JSON)."""
        self.page_size = 2
        """Items per page of a list, whatever ``per_page`` asks (to exercise cursors)."""
        self.ready_after = 2
        """GETs of a pending instance before it is active (``None``: never)."""
        self.faults: list[tuple[str, str, int, dict[str, str]]] = []
        """Queued answers: (method, path prefix, status, headers), each used once, in order."""
        self.fail_create_at: int | None = None
        """The number (1-based) of the create that fails with 500."""
        self.creates = 0
        self._ips = itertools.count(3)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v2"

    def take_fault(self, method: str, path: str) -> tuple[int, dict[str, str]] | None:
        with self.lock:
            for i, (m, prefix, status, headers) in enumerate(self.faults):
                if m == method and path.startswith(prefix):
                    del self.faults[i]
                    return status, headers
        return None

    def stop_all(self) -> None:
        """What the start-up scripts' auto-shutdown does to the instances."""
        with self.lock:
            for instance in self.instances.values():
                instance["power_status"] = "stopped"
                instance["server_status"] = "ok"


class _Handler(BaseHTTPRequestHandler):
    server: VultrServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self, status: int, data: Any = None, headers: dict[str, str] | None = None) -> None:
        body = b"" if data is None else json.dumps(data).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if body:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._answer(status, {"error": message, "status": status}, headers)

    def _handle(self, method: str) -> None:
        server = self.server
        url = urlsplit(self.path)
        path = url.path.removeprefix("/v2")
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        with server.lock:
            server.requests.append(
                {
                    "method": method,
                    "path": path,
                    "query": parse_qs(url.query),
                    "headers": dict(self.headers),
                    "body": body,
                }
            )
        fault = server.take_fault(method, path)
        if fault is not None:
            status, headers = fault
            self._error(status, f"injected {status}", headers)
            return
        if path in ("/plans", "/regions"):
            self._list(path[1:], PLANS if path == "/plans" else REGIONS, parse_qs(url.query))
            return
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            self._error(401, "Invalid API token.")
            return
        if method == "POST" and path == "/instances":
            self._create(body or {})
        elif path.startswith("/instances/") and method in ("GET", "DELETE"):
            instance_id = path.removeprefix("/instances/")
            with server.lock:
                instance = server.instances.get(instance_id)
                if instance is None:
                    self._error(404, "Invalid instance-id.")
                elif method == "DELETE":
                    del server.instances[instance_id]
                    server.deleted.append(instance_id)
                    self._answer(204)
                else:
                    self._advance(instance)
                    self._answer(
                        200,
                        {"instance": {k: v for k, v in instance.items() if not k.startswith("_")}},
                    )
        else:
            self._error(404, "Not found")

    def _list(self, key: str, items: list[dict[str, Any]], query: dict[str, list[str]]) -> None:
        start = int(query.get("cursor", ["0"])[0])
        size = self.server.page_size
        page = items[start : start + size]
        next_cursor = str(start + size) if start + size < len(items) else ""
        meta = {"total": len(items), "links": {"next": next_cursor, "prev": ""}}
        self._answer(200, {key: page, "meta": meta})

    def _create(self, body: dict[str, Any]) -> None:
        server = self.server
        with server.lock:
            server.creates += 1
            if server.fail_create_at == server.creates:
                self._error(500, "Internal server error.")
                return
            for field in ("region", "plan"):
                if field not in body:
                    self._error(400, f"Invalid {field}.")
                    return
            instance_id = str(uuid.uuid4())
            vpc = bool(body.get("enable_vpc") or body.get("attach_vpc"))
            instance = {
                "id": instance_id,
                "os": "Ubuntu 22.04 x64",
                "ram": 6144,
                "disk": 0,
                "main_ip": "0.0.0.0",
                "vcpu_count": 1,
                "region": body["region"],
                "plan": body["plan"],
                "date_created": "2024-01-01T00:00:00+00:00",
                "status": "pending",
                "allowed_bandwidth": 1,
                "netmask_v4": "",
                "gateway_v4": "0.0.0.0",
                "power_status": "running",
                "server_status": "none",
                "v6_network": "",
                "v6_main_ip": "",
                "v6_network_size": 0,
                "label": body.get("label", ""),
                "internal_ip": "",
                "kvm": "",
                "hostname": body.get("hostname", ""),
                "tag": "",
                "tags": body.get("tags", []),
                "os_id": body.get("os_id", 0),
                "app_id": 0,
                "image_id": body.get("image_id", ""),
                "firewall_group_id": "",
                "features": [],
                "default_password": "v5{Sk8#pLanted",
                "_polls": 0,
                "_vpc": vpc,
                "_user_data": body.get("user_data", ""),
            }
            server.instances[instance_id] = instance
            answer = {k: v for k, v in instance.items() if not k.startswith("_")}
        self._answer(202, {"instance": answer})

    def _advance(self, instance: dict[str, Any]) -> None:
        instance["_polls"] += 1
        ready = self.server.ready_after
        if instance["status"] == "pending" and ready is not None and instance["_polls"] >= ready:
            n = next(self.server._ips)
            instance.update(status="active", server_status="ok", main_ip=f"192.0.2.{n}")
            if instance["_vpc"]:
                instance["internal_ip"] = f"10.7.96.{n}"

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")


@contextmanager
def serve() -> Iterator[VultrServer]:
    server = VultrServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
