"""Where the lake's files live (DESIGN.md, "Where the lake lives"): FileIO settings, apart from
which catalog is in use.

The warehouse is a local directory (the zero-config default) or object storage
(``s3://bucket/prefix``, S3-compatible servers included). The storage settings are Iceberg's
own FileIO property names, the ones PyIceberg and Iceberg Java both read, so they are added to
whichever catalog is configured, never in place of it::

    [storage]                                  # icebarrier.toml
    "s3.endpoint" = "http://127.0.0.1:9000"
    "s3.region" = "us-east-1"
    "s3.access-key-id" = "…"                   # the server's and admin commands' keys
    "s3.secret-access-key" = "…"
    [storage.readers]                          # optional: read-only keys vended to reader tokens
    "s3.access-key-id" = "…"
    "s3.secret-access-key" = "…"
    [storage.sessions]                         # optional: vend temporary credentials (STS) instead
    "duration-s" = 3600                        #   of the keys themselves (Trino needs a session token)
    "sts.endpoint" = "http://127.0.0.1:9000"   #   default: s3.endpoint where set, else AWS's STS
    "role-arn" = "arn:aws:iam::…:role/Lake"    #   least privilege: each table's own credentials
                                               #   (AssumeRole with a session policy for its location;
                                               #   without duration-s, STS's default lifetime)

Environment variables (the AWS SDK's own names) win over the file, as for every setting:
``AWS_ENDPOINT_URL_S3`` (or ``AWS_ENDPOINT_URL``), ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``),
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlparse

from icebarrier.control_plane.errors import ConfigurationError

ENDPOINT = "s3.endpoint"
REGION = "s3.region"
ACCESS_KEY_ID = "s3.access-key-id"
SECRET_ACCESS_KEY = "s3.secret-access-key"
SESSION_TOKEN = "s3.session-token"
PATH_STYLE = "s3.path-style-access"
JAVA_REGION = "client.region"  # Iceberg Java's S3FileIO (Spark, Trino's REST client) reads the region here
KEYS = (ENDPOINT, REGION, ACCESS_KEY_ID, SECRET_ACCESS_KEY, SESSION_TOKEN, PATH_STYLE)
SECRETS = (ACCESS_KEY_ID, SECRET_ACCESS_KEY, SESSION_TOKEN)
READERS = "readers"
SESSIONS = "sessions"
SESSION_TOKEN_EXPIRES_AT_MS = "s3.session-token-expires-at-ms"  # Iceberg's name (S3FileIOProperties)
SESSION_DURATION_S, STS_ENDPOINT, ROLE_ARN = "duration-s", "sts.endpoint", "role-arn"

ENV = {
    ENDPOINT: ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    REGION: ("AWS_REGION", "AWS_DEFAULT_REGION"),
    ACCESS_KEY_ID: ("AWS_ACCESS_KEY_ID",),
    SECRET_ACCESS_KEY: ("AWS_SECRET_ACCESS_KEY",),
    SESSION_TOKEN: ("AWS_SESSION_TOKEN",),
}
SCHEMES = ("file", "s3", "s3a")


@dataclass(frozen=True, slots=True, kw_only=True)
class Storage:
    """FileIO settings: ``properties`` for the server, admin commands and jobs; ``readers`` the
    keys a reader token is handed instead (read-only ones), if configured."""

    properties: dict[str, str] = field(default_factory=dict)
    readers: dict[str, str] = field(default_factory=dict)
    # ``[storage.sessions]``: vend STS session credentials of this many seconds (None: the keys)
    session_duration_s: int | None = None
    sts_endpoint: str | None = None
    session_role_arn: str | None = None  # ``role-arn``: credentials scoped to one table (AssumeRole)
    session_duration_asked: bool = False  # ``duration-s`` given (else AssumeRole takes STS's default)

    @classmethod
    def from_config(cls, section: Mapping | None, environ: Mapping[str, str] = os.environ) -> Storage:
        """The ``[storage]`` table of icebarrier.toml, the environment winning over it."""
        section = dict(section or {})
        sessions = section.pop(SESSIONS, None)
        readers = section.pop(READERS, {})
        if not isinstance(readers, Mapping):
            raise ConfigurationError(
                f"[storage.{READERS}] must be a table of {ACCESS_KEY_ID} and {SECRET_ACCESS_KEY}; fix icebarrier.toml"
            )
        properties = _checked(section, "[storage]", KEYS)
        for key, names in ENV.items():
            for name in names:
                if environ.get(name):
                    properties[key] = environ[name]
                    break
        readers = _checked(readers, f"[storage.{READERS}]", SECRETS)
        if readers and not {ACCESS_KEY_ID, SECRET_ACCESS_KEY} <= set(readers):
            raise ConfigurationError(
                f"[storage.{READERS}] needs both {ACCESS_KEY_ID} and {SECRET_ACCESS_KEY}; fix icebarrier.toml"
            )
        duration_s, sts_endpoint, role_arn = _sessions(sessions, properties)
        return cls(
            properties=properties,
            readers=readers,
            session_duration_s=duration_s,
            sts_endpoint=sts_endpoint,
            session_role_arn=role_arn,
            session_duration_asked=isinstance(sessions, Mapping) and SESSION_DURATION_S in sessions,
        )

    def fileio(self) -> dict[str, str]:
        """Properties for PyIceberg's and Iceberg Java's FileIO."""
        return dict(self.properties)

    def public(self) -> dict[str, str]:
        """Where the files are, without any secret (every client may know it); the region also
        under Iceberg Java's name."""
        public = {k: v for k, v in self.properties.items() if k not in SECRETS}
        if REGION in public:
            public[JAVA_REGION] = public[REGION]
        return public

    def vended(self, *, reader: bool) -> dict[str, str]:
        """What the catalog hands a client that asked for vended credentials: the endpoint and
        the keys, a reader's read-only keys when configured (else none: see docs/storage.md)."""
        return {**self.public(), **(self.readers if reader else self.fileio())}


def _sessions(section: Mapping | None, properties: Mapping[str, str]) -> tuple[int | None, str | None, str | None]:
    """``[storage.sessions]``: the credentials' lifetime (STS allows 900 s to 36 hours), STS's
    endpoint, and the role to assume for per-table credentials."""
    if section is None:
        return None, None, None
    where = f"[storage.{SESSIONS}]"
    known = (SESSION_DURATION_S, STS_ENDPOINT, ROLE_ARN)
    if not isinstance(section, Mapping):
        raise ConfigurationError(f"{where} must be a table ({', '.join(known)}); fix icebarrier.toml")
    values = _checked(section, where, known)
    try:
        duration_s = int(values.get(SESSION_DURATION_S, 3600))
    except ValueError:
        duration_s = 0
    if not 900 <= duration_s <= 129_600:
        raise ConfigurationError(
            f"{where} {SESSION_DURATION_S} = {values.get(SESSION_DURATION_S)!r} is out of range; "
            f"STS grants 900 to 129600 seconds"
        )
    role_arn = values.get(ROLE_ARN)
    if role_arn is not None and not re.fullmatch(r"arn:[\w-]+:iam::(\d*:)?role/[\w+=,.@/-]+", role_arn):
        raise ConfigurationError(
            f"{where} {ROLE_ARN} = {role_arn!r} is not a role's ARN; use arn:aws:iam::ACCOUNT:role/NAME"
        )
    if role_arn is not None and not {ACCESS_KEY_ID, SECRET_ACCESS_KEY} <= set(properties):
        raise ConfigurationError(
            f"{where} {ROLE_ARN} needs the server's keys to assume it; set s3.access-key-id and s3.secret-access-key"
        )
    return duration_s, values.get(STS_ENDPOINT) or properties.get(ENDPOINT), role_arn


def _checked(section: Mapping, where: str, known: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for key, value in section.items():
        if key not in known:
            raise ConfigurationError(f"{where} has unknown key {key!r}; known: {', '.join(known)}")
        if isinstance(value, bool):
            value = "true" if value else "false"
        if not isinstance(value, str | int) or value == "":
            raise ConfigurationError(f"{where} {key} must be a non-empty string; fix icebarrier.toml")
        out[key] = str(value)
    return out


def scheme(warehouse: str) -> str:
    return urlparse(warehouse).scheme


def is_object_storage(warehouse: str) -> bool:
    return scheme(warehouse) in ("s3", "s3a")


def local_folder(warehouse: str) -> str:
    """The folder of a local warehouse (a path, or a ``file:`` URI)."""
    return urlparse(warehouse).path if warehouse.startswith("file:") else warehouse


def make_local(warehouse: str) -> None:
    """Create a local warehouse's folder if it does not exist yet (``serve`` is often the first to
    use it); one line naming it if it cannot be created or written. Object storage: nothing."""
    if is_object_storage(warehouse):
        return
    folder = local_folder(warehouse)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(
            f"warehouse {warehouse}: its folder cannot be created ({exc.strerror}); create it, or set "
            f"--warehouse / ICEBARRIER_WAREHOUSE to a folder this user may write"
        ) from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigurationError(
            f"warehouse {warehouse}: this user may not write its folder; grant it, or set "
            f"--warehouse / ICEBARRIER_WAREHOUSE to a folder this user may write"
        )


def validate_warehouse(warehouse: str) -> None:
    parsed = urlparse(warehouse)
    if parsed.scheme not in SCHEMES:
        raise ConfigurationError(
            f"warehouse {warehouse!r} has an unsupported scheme; use a local path, file://… or s3://bucket/prefix"
        )
    if parsed.scheme != "file" and not parsed.netloc:
        raise ConfigurationError(f"warehouse {warehouse!r} names no bucket; use s3://bucket/prefix")


def remove_tree(location: str, properties: Mapping[str, str]) -> None:
    """Delete everything under ``location`` (a scratch warehouse: the demo's, the checker's), on a
    local directory or on object storage."""
    from pyiceberg.io.pyarrow import PyArrowFileIO

    scheme_, netloc, path = PyArrowFileIO.parse_location(location)
    fs = PyArrowFileIO(dict(properties)).fs_by_scheme(scheme_, netloc)
    try:
        fs.delete_dir(path)
    except FileNotFoundError:
        pass


def check_warehouse(warehouse: str, properties: Mapping[str, str]) -> None:
    """:func:`validate_warehouse`, then :func:`check`."""
    validate_warehouse(warehouse)
    check(warehouse, properties)


def check(warehouse: str, properties: Mapping[str, str]) -> None:
    """Write, read and delete a probe object under an object-storage warehouse, so that a wrong
    bucket, endpoint or key is one line naming the setting at start-up, not a traceback at the
    first commit. A local warehouse needs no check."""
    if not is_object_storage(warehouse):
        return
    from pyiceberg.io import load_file_io

    probe = f"{warehouse.rstrip('/')}/.icebarrier-probe-{uuid.uuid4().hex}"
    try:
        io = load_file_io(dict(properties), probe)
        with io.new_output(probe).create(overwrite=True) as out:
            out.write(b"icebarrier")
        with io.new_input(probe).open() as f:
            f.read()
        io.delete(probe)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(explain(warehouse, properties, exc)) from None


def explain(warehouse: str, properties: Mapping[str, str], exc: BaseException) -> str:
    """One line naming the setting that is wrong and the fix."""
    text = str(exc)
    bucket = urlparse(warehouse).netloc
    endpoint = properties.get(ENDPOINT, "the AWS default")
    if "NoSuchBucket" in text or "NO_SUCH_BUCKET" in text or "bucket does not exist" in text.lower():
        return (
            f"bucket {bucket!r} of warehouse {warehouse} does not exist at {endpoint}; create it or fix "
            f"warehouse / ICEBARRIER_WAREHOUSE"
        )
    if any(
        s in text
        for s in (
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "ACCESS_DENIED",
            "AccessDenied",
            "INVALID_ACCESS_KEY",
            "Forbidden",
        )
    ) or re.search(r"\b403\b", text):  # a status, not "403" inside the probe's random name
        return (
            f"the storage keys were refused writing to {warehouse} at {endpoint}; fix {ACCESS_KEY_ID} / "
            f"{SECRET_ACCESS_KEY} in [storage] (or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
        )
    if any(s in text for s in ("connect", "Connect", "resolve", "curlCode", "NETWORK_CONNECTION", "timed out")):
        return (
            f"the object store at {endpoint} cannot be reached for warehouse {warehouse}; fix {ENDPOINT} in "
            f"[storage] (or AWS_ENDPOINT_URL_S3)"
        )
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return (
        f"warehouse {warehouse} is not usable with the [storage] settings ({first[:200]}); fix {ENDPOINT}, "
        f"the keys or the bucket"
    )
