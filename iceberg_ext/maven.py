"""Artifacts from Maven Central, the standard way: pinned versions, fetched once by ``mvn`` into the
local Maven repository, verified against a SHA-256 pinned here before every use.

A Spark start, ``icebarrier spark-conf`` and the suite's Trino and conformance-kit fixtures call
:func:`resolve`; only the first use on a machine reaches the network (``mvn dependency:get``, which
honours the user's ``settings.xml``: mirrors, proxies). After that the jar is read from the cache
(``ICEBARRIER_MAVEN_REPO``, default ``~/.m2/repository``, the same cache Maven uses) and its checksum
is checked once per file version (a stamp beside it records inode, size, mtime and digest).

An artifact's own environment variable (``ICEBARRIER_ICEBERG_JAR``…) names a local copy instead:
used as given, never fetched. Where neither works the error names the artifact, its coordinates and
that variable, in one line.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from icebarrier.iceberg_ext.errors import ArtifactUnavailableError

REPOSITORY_ENV = "ICEBARRIER_MAVEN_REPO"
_FETCH_TIMEOUT_S = 1800  # Trino's server is 800 MB


@dataclass(frozen=True, slots=True, kw_only=True)
class Artifact:
    """One pinned file on Maven Central. ``env`` names a variable that points at a local copy."""

    title: str
    group: str
    artifact: str
    version: str
    sha256: str
    env: str
    packaging: str = "jar"
    classifier: str = ""

    @property
    def coordinates(self) -> str:
        """``group:artifact:version[:packaging[:classifier]]``, as ``mvn dependency:get`` takes them."""
        tail = (
            f":{self.packaging}:{self.classifier}"
            if self.classifier
            else (f":{self.packaging}" if self.packaging != "jar" else "")
        )
        return f"{self.group}:{self.artifact}:{self.version}{tail}"

    @property
    def file_name(self) -> str:
        classifier = f"-{self.classifier}" if self.classifier else ""
        return f"{self.artifact}-{self.version}{classifier}.{self.packaging}"

    def path_in(self, repository: Path) -> Path:
        return repository.joinpath(*self.group.split("."), self.artifact, self.version, self.file_name)


def repository() -> Path:
    """The local Maven repository the artifacts are cached in."""
    return Path(os.environ.get(REPOSITORY_ENV) or Path.home() / ".m2" / "repository").expanduser()


def resolve(artifact: Artifact) -> Path:
    """The local path of ``artifact``: the file its variable names, else the cached copy (fetched
    with ``mvn`` on first use), its SHA-256 checked.

    Raises ArtifactUnavailableError."""
    override = os.environ.get(artifact.env)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise _unavailable(artifact, f"{artifact.env}={override} does not exist; point it at {artifact.file_name}")
        return path
    path = artifact.path_in(repository())
    if not path.is_file():
        _fetch(artifact)
    _verify(artifact, path)
    return path


def _fetch(artifact: Artifact) -> None:
    """``mvn dependency:get`` into the cache, one process at a time per cache (a file lock)."""
    mvn = shutil.which("mvn")
    if mvn is None:
        raise _unavailable(
            artifact,
            f"{artifact.file_name} is not in the Maven cache and `mvn` is not installed (apt-get install maven)",
        )
    repo = repository()
    repo.mkdir(parents=True, exist_ok=True)
    with open(repo / ".icebarrier-fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if artifact.path_in(repo).is_file():  # another process fetched it while this one waited
            return
        cmd = [mvn, "-B", "-q", "-U", f"-Dmaven.repo.local={repo}", "dependency:get", "-Dtransitive=false"]
        try:
            done = subprocess.run(
                [*cmd, f"-Dartifact={artifact.coordinates}"],
                capture_output=True,
                text=True,
                timeout=_FETCH_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise _unavailable(artifact, f"mvn did not fetch it in {_FETCH_TIMEOUT_S} s") from None
        if done.returncode != 0 or not artifact.path_in(repo).is_file():
            reason = next((line for line in done.stdout.splitlines() if "ERROR" in line), done.stderr.strip()[-300:])
            raise _unavailable(artifact, f"mvn could not fetch it ({_plain(reason)[:300]})")


def _verify(artifact: Artifact, path: Path) -> None:
    stat = path.stat()
    stamp = path.with_name(path.name + ".icebarrier-sha256")
    mark = f"{stat.st_ino} {stat.st_size} {stat.st_mtime_ns} {artifact.sha256}"
    if stamp.is_file() and stamp.read_text() == mark:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != artifact.sha256:
        raise ArtifactUnavailableError(
            f"{artifact.title} {path} has SHA-256 {digest.hexdigest()}, not the pinned {artifact.sha256}; "
            f"delete it (the next use fetches it again) or set {artifact.env} to a copy you trust",
            coordinates=artifact.coordinates,
        )
    try:
        stamp.write_text(mark)
    except OSError:
        pass  # a read-only cache: verified again next time


def _unavailable(artifact: Artifact, why: str) -> ArtifactUnavailableError:
    return ArtifactUnavailableError(
        f"{artifact.title} ({artifact.coordinates}) is unavailable: {why}. "
        f"Run where Maven Central is reachable, or set {artifact.env} to a local {artifact.file_name}",
        coordinates=artifact.coordinates,
    )


def _plain(text: str) -> str:
    """``text`` without ANSI colours and Maven's ``[ERROR]`` prefix."""
    return re.sub(r"\x1b\[[0-9;]*m|\[ERROR\]\s*", "", text).strip()
