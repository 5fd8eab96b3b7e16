"""A real object store that enforces STS session policies, for the least-privilege tests:
SeaweedFS (``weed mini``: master, volume, filer and S3 with STS in one process; Apache-2.0).
moto's S3 server enforces no policy, so a test of scoped credentials on it proves nothing.

The binary is built once from Go's module proxy at one pinned version, its module hash checked
(``go mod download`` verifies it against the checksum database, and we compare it with the one
pinned here), then cached under ``~/.cache/icebarrier/seaweedfs/<version>/weed``. ``go install``
refuses the module (its go.mod has ``replace`` directives): the module is copied out of Go's
cache and built inside it. The first build takes minutes (README); later ones nothing.

    python -m tests.seaweedfs          # build it now (what .ci/run does before the tests)

    with seaweed(tmp_path) as store:
        store.sts(...)                 # boto3 clients on its S3/STS endpoint
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from icebarrier.iceberg_ext.config import cache_dir as icebarrier_cache

MODULE = "github.com/seaweedfs/seaweedfs"
VERSION = "v0.0.0-20261109003541-7506e5f91cd6"
MODULE_SUM = "h1:LOYZFToHq9F7pSR6lkPGfkM8RmHlVFrzndKdhmNZjrU="  # go mod download's Sum: the module's hash
BINARY_ENV = "ICEBARRIER_SEAWEEDFS"  # a weed binary to use instead of building one
BUCKET = "lake"
ADMIN_KEY, ADMIN_SECRET = "lakeadmin", "lakeadmin-secret-0123456789"
ROLE_ARN = "arn:aws:iam::role/Lake"  # the role the catalog assumes; its policy allows everything on the bucket
REGION = "us-east-1"


def cache_dir() -> Path:
    return icebarrier_cache("seaweedfs", VERSION)


def binary() -> Path:
    """The ``weed`` binary: built once (under a lock: parallel test workers wait for one build)."""
    if os.environ.get(BINARY_ENV):
        return Path(os.environ[BINARY_ENV])
    home = cache_dir()
    weed = home / "weed"
    if weed.is_file():
        return weed
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if weed.is_file():
            return weed
        _build(home, weed)
    return weed


def _build(home: Path, weed: Path) -> None:
    started = time.monotonic()
    done = subprocess.run(
        ["go", "mod", "download", "-json", f"{MODULE}@{VERSION}"], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"go mod download {MODULE}@{VERSION} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    module = json.loads(done.stdout)
    if module.get("Sum") != MODULE_SUM:
        raise RuntimeError(f"{MODULE}@{VERSION} has hash {module.get('Sum')}, not the pinned {MODULE_SUM}")
    source = home / "src"
    if source.exists():  # an earlier build cut short
        subprocess.run(["chmod", "-R", "u+w", str(source)], check=True)
        shutil.rmtree(source)
    shutil.copytree(module["Dir"], source)
    subprocess.run(["chmod", "-R", "u+w", str(source)], check=True)  # Go's cache is read-only
    partial = home / "weed.partial"
    subprocess.run(["go", "build", "-o", str(partial), "./weed"], cwd=source, check=True)
    partial.rename(weed)
    shutil.rmtree(source, ignore_errors=True)
    print(f"seaweedfs: built {weed} in {time.monotonic() - started:.0f}s", file=sys.stderr)


def _free_ports(n: int) -> list[int]:
    """``n`` free ports whose +10000 twins (the gRPC ports) are free too."""
    found: list[int] = []
    while len(found) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in found:
            continue
        with socket.socket() as twin:
            try:
                twin.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        found.append(port)
    return found


def config(*, token_duration: str = "1h") -> dict:
    """The S3/IAM/STS file: an admin identity (the catalog's keys), STS, and the role the catalog
    assumes (its attached policy allows everything on the bucket; a session policy narrows it)."""
    return {
        "identities": [
            {
                "name": "lake-admin",
                "credentials": [{"accessKey": ADMIN_KEY, "secretKey": ADMIN_SECRET}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ],
        "sts": {
            "tokenDuration": token_duration,
            "maxSessionLength": "12h",
            "issuer": "seaweedfs-sts",
            "signingKey": base64.b64encode(b"icebarrier-test-sts-signing-key!").decode(),
        },
        "policy": {"defaultEffect": "Deny", "storeType": "memory"},
        "policies": [
            {
                "name": "LakeAll",
                "document": {
                    "Version": "2012-10-17",
                    "Statement": [
                        {
                            "Effect": "Allow",
                            "Action": ["s3:*"],
                            "Resource": [f"arn:aws:s3:::{BUCKET}", f"arn:aws:s3:::{BUCKET}/*"],
                        }
                    ],
                },
            },
        ],
        "roles": [
            {
                "roleName": "Lake",
                "roleArn": ROLE_ARN,
                "attachedPolicies": ["LakeAll"],
                "trustPolicy": {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Principal": {"AWS": ["*"]}, "Action": ["sts:AssumeRole"]}],
                },
            }
        ],
    }


@dataclass
class SeaweedFS:
    endpoint: str
    proc: subprocess.Popen
    log: Path

    def storage_toml(self) -> str:
        """icebarrier.toml's storage: the admin's keys for the server, and per-table credentials
        (the role assumed with a session policy; 900 s, STS's shortest)."""
        return (
            f'[storage]\n"s3.endpoint" = "{self.endpoint}"\n"s3.region" = "{REGION}"\n'
            f'"s3.access-key-id" = "{ADMIN_KEY}"\n"s3.secret-access-key" = "{ADMIN_SECRET}"\n'
            f'"s3.path-style-access" = "true"\n'
            f'[storage.sessions]\n"duration-s" = 900\n"role-arn" = "{ROLE_ARN}"\n'
        )

    def client(self, service: str = "s3", **credentials):
        import boto3
        from botocore.config import Config

        keys = credentials or {"aws_access_key_id": ADMIN_KEY, "aws_secret_access_key": ADMIN_SECRET}
        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
            **keys,
        )


@contextlib.contextmanager
def seaweed(work: Path, *, bucket: str = BUCKET, token_duration: str = "1h") -> Iterator[SeaweedFS]:
    """``weed mini`` on free ports under ``work``, with ``bucket`` made; stopped by its own pid
    (``token_duration``: STS's lifetime for credentials asked without one)."""
    import requests

    weed = binary()
    work.mkdir(parents=True, exist_ok=True)
    conf = work / "s3.json"
    conf.write_text(json.dumps(config(token_duration=token_duration)))
    master, volume, filer, s3, admin = _free_ports(5)
    flags = {"master": master, "volume": volume, "filer": filer, "s3": s3, "admin": admin}
    args = [str(weed), "mini", "-ip", "127.0.0.1", "-ip.bind", "127.0.0.1", "-dir", str(work / "data")]
    for name, port in flags.items():
        args += [f"-{name}.port={port}", f"-{name}.port.grpc={port + 10000}"]
    args += ["-admin.port.legacy=0", "-webdav=false", "-s3.port.lance=0", "-s3.port.iceberg=0"]
    args += ["-s3.config", str(conf), "-s3.iam.config", str(conf), "-s3.iam.readOnly=false"]
    log = work / "weed.log"
    (work / "data").mkdir(exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    store = SeaweedFS(endpoint=f"http://127.0.0.1:{s3}", proc=proc, log=log)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"weed mini exited {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                if requests.get(f"{store.endpoint}/status", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed mini did not answer in 60s: {log.read_text()[-3000:]}")
            time.sleep(0.2)
        _make_bucket(store, bucket)
        yield store
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def _make_bucket(store: SeaweedFS, bucket: str) -> None:
    """The filer may take a moment after /status answers: try for a while."""
    s3 = store.client()
    deadline = time.monotonic() + 30
    while True:
        try:
            s3.create_bucket(Bucket=bucket)
            return
        except Exception as exc:  # noqa: BLE001 - not ready yet, or a real refusal: retried, then raised
            if "BucketAlreadyOwnedByYou" in str(exc) or "BucketAlreadyExists" in str(exc):
                return
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


if __name__ == "__main__":
    started = time.monotonic()
    print(binary(), f"({time.monotonic() - started:.0f}s)")
