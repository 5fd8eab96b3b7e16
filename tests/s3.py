"""An S3-compatible server on 127.0.0.1 for the object-storage tests: moto's server in a process
of its own (``moto_server``, from the test extra), a bucket per test run."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REGION = "us-east-1"
ACCESS_KEY, SECRET_KEY = "icebarrier-writer", "writer-secret"
READER_KEY, READER_SECRET = "icebarrier-reader", "reader-secret"


@dataclass(frozen=True)
class S3:
    endpoint: str
    bucket: str

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def storage_toml(self, *, sessions: bool = False) -> str:
        """The ``[storage]`` section of icebarrier.toml for this server (and read-only-by-policy
        keys for readers; ``sessions``: vend STS session credentials made from them, moto's STS)."""
        return (
            f'[storage]\n"s3.endpoint" = "{self.endpoint}"\n"s3.region" = "{REGION}"\n'
            f'"s3.access-key-id" = "{ACCESS_KEY}"\n"s3.secret-access-key" = "{SECRET_KEY}"\n'
            f'"s3.path-style-access" = "true"\n'
            f'[storage.readers]\n"s3.access-key-id" = "{READER_KEY}"\n"s3.secret-access-key" = "{READER_SECRET}"\n'
        ) + ('[storage.sessions]\n"duration-s" = 900\n' if sessions else "")

    def keys(self, prefix: str = "") -> set[str]:
        """Every object key in the bucket under ``prefix`` (not the directory markers pyarrow leaves)."""
        found, client = set(), self.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            found |= {o["Key"] for o in page.get("Contents", []) if not o["Key"].endswith("/")}
        return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(log: Path) -> Iterator[S3]:
    """A moto S3 server process on a free port with one fresh bucket; stopped at the end."""
    port = _free_port()
    exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    with open(log, "w") as out:
        proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the S3 server did not start"
                time.sleep(0.1)
        s3 = S3(endpoint=f"http://127.0.0.1:{port}", bucket=f"icebarrier-{uuid.uuid4().hex[:12]}")
        s3.client().create_bucket(Bucket=s3.bucket)
        yield s3
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
