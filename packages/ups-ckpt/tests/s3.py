"""A real S3 API for tests: a moto server on 127.0.0.1, reached through boto3 and s3fs.

Register it from a test module with ``pytest_plugins = ["s3"]``, then ask for ``s3``: a fresh
prefix in a bucket of a server shared by the session. Nothing leaves 127.0.0.1: the server
listens there, and the session's environment holds dummy credentials and no AWS profile, so no
client looks elsewhere for them. When moto is not installed the tests that use it fail.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import attrs
import boto3
import pytest

from ups.core.testing import free_port, wait_for

BUCKET = "ups-checkpoints"
ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
"""Set for the whole session, so spawned ranks inherit it."""
START_TIMEOUT_S = 30.0


@attrs.frozen
class S3Prefix:
    """A prefix of its own in the test bucket."""

    endpoint: str
    client: Any
    """A boto3 S3 client of the server, to look at and tamper with what was written."""
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{BUCKET}/{self.prefix}"

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint}

    def objects(self) -> list[str]:
        """Every object under the prefix, relative to it, sorted."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=f"{self.prefix}/"
        )
        start = len(self.prefix) + 1
        return sorted(o["Key"][start:] for page in pages for o in page.get("Contents", []))

    def get(self, key: str) -> bytes:
        body: bytes = self.client.get_object(Bucket=BUCKET, Key=f"{self.prefix}/{key}")[
            "Body"
        ].read()
        return body

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=f"{self.prefix}/{key}", Body=data)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """Start a moto server on 127.0.0.1, make the test bucket, yield its URL; stop it after."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as output, pytest.MonkeyPatch.context() as env:
        for name, value in ENVIRONMENT.items():
            env.setenv(name, value)
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_until_listening(server, port, output)
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
            yield endpoint
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


@pytest.fixture
def s3(s3_endpoint: str) -> S3Prefix:
    """A fresh prefix in the test bucket of the session's moto server."""
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    return S3Prefix(s3_endpoint, client, f"run-{uuid.uuid4().hex[:12]}/checkpoints")


def _wait_until_listening(server: subprocess.Popen[bytes], port: int, output: Any) -> None:
    """Return once the server accepts connections; raise with its output if it exits first."""

    def listening() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    def logged() -> str:
        output.seek(0)
        return f"(is moto[server] installed?)\n{output.read().decode(errors='replace')}"

    wait_for(
        listening,
        START_TIMEOUT_S,
        f"the moto server to listen on 127.0.0.1:{port}",
        process=server,
        details=logged,
    )
