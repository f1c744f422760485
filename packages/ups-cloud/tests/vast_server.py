"""A loopback stand-in for the VastAI API, answering the endpoints the real ``vastai`` client
(1.9.1, ``vastai.api``) calls, with the response shapes its code reads:

- ``POST /api/v0/bundles/`` (``offers.search_offers``): ``{"offers": [...]}``;
- ``PUT /api/v0/asks/ID/`` (``instances.create_instance_from_payload``):
  ``{"success": true, "new_contract": ID}``;
- ``GET /api/v0/instances/ID/?owner=me`` (``instances.show_instance``):
  ``{"instances": {... "start_date", "extra_env": [[k, v]], "actual_status" ...}}`` or
  ``{"instances": null}``;
- ``DELETE /api/v0/instances/ID/`` (``instances.destroy_instance``): ``{"success": true}``;
- ``PUT /api/v0/instances/ID/`` (``label_instance``: ``{"label"}``, ``stop_instance``:
  ``{"state": "stopped"}``), as the ``vastai`` CLI sends them: ``{"success": true}``;
- ``PUT /api/v0/instances/request_logs/ID/`` (``instances.logs``): ``{"result_url": URL}``,
  then ``GET URL`` (plain ``requests.get``, no key): the log text.

State lives in memory; ``faults`` makes it answer 401, 429 (``n`` times, then normally, with
a ``Retry-After`` header if one is set), 500, or keeps instances ``loading`` for ever. Every request's headers and body are kept in
``requests`` so that a test can check what was sent.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

OFFERS: list[dict[str, Any]] = [
    {"id": 101, "gpu_name": "RTX 4090", "num_gpus": 2, "gpu_ram": 24564, "reliability": 0.99,
     "dph_total": 0.80},
    {"id": 102, "gpu_name": "RTX 4090", "num_gpus": 2, "gpu_ram": 24564, "reliability": 0.97,
     "dph_total": 0.70},
    {"id": 103, "gpu_name": "RTX 4090", "num_gpus": 1, "gpu_ram": 24564, "reliability": 0.995,
     "dph_total": 0.35},
    {"id": 201, "gpu_name": "H100 SXM", "num_gpus": 8, "gpu_ram": 81559, "reliability": 0.999,
     "dph_total": 19.5},
    {"id": 301, "gpu_name": "RTX 3090", "num_gpus": 2, "gpu_ram": 24576, "reliability": 0.90,
     "dph_total": 0.30},
]  # fmt: skip


class VastServer:
    """A ``ThreadingHTTPServer`` on 127.0.0.1 in a thread; use as a context manager."""

    def __init__(self, api_key: str, *, ready_after: int = 1) -> None:
        self.api_key = api_key
        self.ready_after = ready_after
        """How many ``show`` requests an instance answers ``loading`` before ``running``."""
        self.offers = [dict(o) for o in OFFERS]
        self.instances: dict[int, dict[str, Any]] = {}
        self.destroyed: list[int] = []
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.faults: dict[str, Any] = {}
        """``unauthorized``: True; ``rate_limit``: {path regex: n}; ``retry_after``: the 429's
        ``Retry-After`` value (default: none); ``error``: {regex: code}; ``never_ready``: True."""
        self.logs: dict[int, str] = {}
        self.lock = threading.Lock()
        self._next_id = 9000
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> VastServer:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def live(self) -> list[int]:
        """The instances not destroyed."""
        return sorted(self.instances)

    # -- request handling ---------------------------------------------------------------------

    def answer(
        self, method: str, path: str, query: dict[str, list[str]], body: Any, auth: str | None
    ) -> tuple[int, Any, dict[str, str]]:
        if path.startswith("/logs/"):
            return 200, self.logs.get(int(path.split("/")[2]), ""), {}
        if self.faults.get("unauthorized") or auth != f"Bearer {self.api_key}":
            return 401, {"error": "invalid_api_key", "msg": "bad key"}, {}
        for pattern, left in self.faults.get("rate_limit", {}).items():
            if re.search(pattern, f"{method} {path}") and left > 0:
                self.faults["rate_limit"][pattern] = left - 1
                after = self.faults.get("retry_after")
                return (
                    429,
                    {"error": "rate_limited"},
                    {} if after is None else {"Retry-After": after},
                )
        for pattern, code in self.faults.get("error", {}).items():
            if re.search(pattern, f"{method} {path}"):
                return code, {"error": "server_error"}, {}
        if (method, path) == ("POST", "/api/v0/bundles/"):
            return 200, {"offers": self._search(body)}, {}
        if (m := re.fullmatch(r"/api/v0/asks/(\d+)/", path)) and method == "PUT":
            return self._create(int(m.group(1)), body)
        if m := re.fullmatch(r"/api/v0/instances/request_logs/(\d+)/", path):
            if int(m.group(1)) not in self.instances:
                return 404, {"error": "no_such_instance"}, {}
            return 200, {"result_url": f"{self.url}/logs/{m.group(1)}"}, {}
        if m := re.fullmatch(r"/api/v0/instances/(\d+)/", path):
            instance_id = int(m.group(1))
            if method == "GET":
                assert query.get("owner") == ["me"]
                return 200, {"instances": self._show(instance_id)}, {}
            if method == "PUT":  # label_instance, stop_instance, start_instance
                row = self.instances.get(instance_id)
                if row is None:
                    return 404, {"error": "no_such_instance"}, {}
                if "label" in body:
                    row["label"] = body["label"]
                if body.get("state") == "stopped":
                    row.update(intended_status="stopped", actual_status="exited")
                return 200, {"success": True}, {}
            if method == "DELETE":
                if self.instances.pop(instance_id, None) is None:
                    return 404, {"error": "no_such_instance"}, {}
                self.destroyed.append(instance_id)
                return 200, {"success": True}, {}
        return 404, {"error": f"no endpoint {method} {path}"}, {}

    def _search(self, q: dict[str, Any]) -> list[dict[str, Any]]:
        found = []
        for offer in self.offers:
            ok = True
            for field, cond in q.items():
                if field in ("order", "type", "limit", "allocated_storage"):
                    continue
                if not isinstance(cond, dict) or field not in offer:
                    continue  # the defaults (verified, rentable...) hold for every offer here
                value = offer[field]
                for op, wanted in cond.items():
                    ok &= {
                        "eq": value == wanted,
                        "gte": value >= wanted,
                        "lte": value <= wanted,
                    }[op]
            if ok:
                found.append(offer)
        for field, direction in reversed(q.get("order", [])):
            found.sort(key=lambda o: o[field], reverse=direction == "desc")
        return found[: q.get("limit") or None]

    def _create(self, offer_id: int, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        offer = next((o for o in self.offers if o["id"] == offer_id), None)
        if offer is None:
            return 404, {"success": False, "error": "no_such_ask"}, {}
        self._next_id += 1
        instance_id = self._next_id
        self.instances[instance_id] = {
            "id": instance_id, "machine_id": offer_id, "actual_status": None,
            "intended_status": "running", "cur_state": "running", "label": body.get("label"),
            "num_gpus": offer["num_gpus"], "gpu_name": offer["gpu_name"],
            "dph_total": offer["dph_total"], "start_date": time.time(),
            "extra_env": [[k, v] for k, v in (body.get("env") or {}).items()],
            "onstart": body.get("onstart"), "image_uuid": body.get("image"),
            "public_ipaddr": f"203.0.113.{instance_id % 250}\n", "status_msg": "",
            "ports": {"29500/tcp": [{"HostIp": "0.0.0.0", "HostPort": str(40000 + instance_id % 1000)}]},
            "_shows": 0,
        }  # fmt: skip
        return 200, {"success": True, "new_contract": instance_id}, {}

    def _show(self, instance_id: int) -> dict[str, Any] | None:
        row = self.instances.get(instance_id)
        if row is None:
            return None
        row["_shows"] += 1
        if row["actual_status"] is None or row["actual_status"] == "loading":
            ready = not self.faults.get("never_ready") and row["_shows"] > self.ready_after
            row["actual_status"] = "running" if ready else "loading"
        return {k: v for k, v in row.items() if not k.startswith("_")}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def _any(self) -> None:
                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                with server.lock:
                    server.requests.append(
                        (self.command, self.path, dict(self.headers.items()), raw)
                    )
                    body = json.loads(raw) if raw else {}
                    code, answer, headers = server.answer(
                        self.command,
                        parts.path,
                        parse_qs(parts.query),
                        body,
                        self.headers.get("Authorization"),
                    )
                data = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = _any  # noqa: N815

        return Handler
