"""Iceberg's jars from Maven Central: fetched once by the real `mvn` into a cache, checked against
pinned digests, never fetched again; without them, one line naming the jar and its variable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from icebarrier.iceberg_ext import maven
from icebarrier.iceberg_ext.errors import ArtifactUnavailableError
from icebarrier.iceberg_ext.spark import POSTGRES_JDBC
from icebarrier.iceberg_ext.spark_lines import installed

BIN = str(Path(sys.executable).parent)  # python and the icebarrier script, not mvn


def icebarrier(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [f"{BIN}/icebarrier", *args], capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def test_without_the_jar_or_maven_a_spark_start_is_one_line_naming_the_jar_and_its_variable(lake, tmp_path):
    """An empty Maven cache and no `mvn` on PATH: `spark-conf` and `query` exit 1 with one line
    naming the runtime jar's coordinates and ICEBARRIER_ICEBERG_JAR; nothing is written."""
    repo = tmp_path / "m2"
    env = {"PATH": BIN, maven.REPOSITORY_ENV: str(repo)}
    for args in (["spark-conf"], ["query", "SELECT 1"]):
        done = icebarrier(*args, env=env)
        assert done.returncode == 1, done
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
        assert installed().runtime.coordinates in done.stderr and "ICEBARRIER_ICEBERG_JAR" in done.stderr
        assert "mvn" in done.stderr and not done.stdout
    assert not repo.exists()


def test_a_local_copy_that_is_missing_or_fails_its_checksum_is_refused(lake, tmp_path, monkeypatch):
    """ICEBARRIER_ICEBERG_JAR naming no file, and a cached jar whose digest is not the pinned one:
    one line each naming the file and the fix; the bad copy is left where it is."""
    done = icebarrier("spark-conf", env={"ICEBARRIER_ICEBERG_JAR": str(tmp_path / "nope.jar")})
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert "ICEBARRIER_ICEBERG_JAR=" in done.stderr and "nope.jar does not exist" in done.stderr
    repo = tmp_path / "m2"
    bad = installed().runtime.path_in(repo)
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"PK\x03\x04 not the runtime")
    done = icebarrier("spark-conf", env={maven.REPOSITORY_ENV: str(repo)})
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert str(bad) in done.stderr and installed().runtime.sha256 in done.stderr and "delete it" in done.stderr
    assert files_under(repo) == [bad]


# What `mvn dependency:get` itself loads (its plugin and that plugin's libraries): a new cache fetches
# them from Maven Central first, 44 s here. Anything missing from this list is fetched as before.
MAVENS_OWN = (
    "org/apache/maven", "org/codehaus/plexus", "org/eclipse/aether", "org/apache/velocity", "classworlds",
    "commons-beanutils", "commons-cli", "commons-collections", "commons-digester", "commons-io", "commons-lang",
    "commons-logging", "commons-validator", "asm", "junit", "oro", "xml-apis",
)  # fmt: skip


def _cache_without(tmp_path: Path, artifact: maven.Artifact) -> Path:
    """A Maven cache as on a machine where `mvn` ran before (Maven's own files from this one's, jars
    linked: mvn never writes one in place; the rest copied: it updates its records in place),
    which does not hold ``artifact``."""
    home, cache = maven.repository(), tmp_path / "m2"
    for own in MAVENS_OWN:
        if (home / own).is_dir():
            shutil.copytree(
                home / own,
                cache / own,
                copy_function=lambda src, dst: os.link(src, dst) if src.endswith(".jar") else shutil.copy2(src, dst),
            )
    assert not artifact.path_in(cache).exists()
    return cache


def test_a_jar_is_fetched_once_by_maven_then_read_from_the_cache(tmp_path, monkeypatch):
    """The first use fetches the pinned jar with the real `mvn` (Maven Central) into the cache and
    checks its digest; later uses need neither the network nor `mvn`."""
    monkeypatch.setenv(maven.REPOSITORY_ENV, str(_cache_without(tmp_path, POSTGRES_JDBC)))
    monkeypatch.delenv(POSTGRES_JDBC.env, raising=False)
    path = maven.resolve(POSTGRES_JDBC)
    assert path == POSTGRES_JDBC.path_in(tmp_path / "m2") and path.stat().st_size > 500_000
    monkeypatch.setenv("PATH", BIN)
    assert maven.resolve(POSTGRES_JDBC) == path
    stat = path.stat()
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the same size, changed later: checked again
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    with pytest.raises(ArtifactUnavailableError, match="not the pinned"):
        maven.resolve(POSTGRES_JDBC)


def test_an_artifact_maven_central_does_not_serve_is_one_clear_error(tmp_path, monkeypatch):
    """Coordinates Maven Central refuses: the error names them and the variable, in one line."""
    missing = maven.Artifact(
        title="a jar nobody published",
        group="org.apache.iceberg",
        artifact="iceberg-aws-bundle",
        version="0.0.0-none",
        sha256="0" * 64,
        env="ICEBARRIER_TEST_NONE_JAR",
    )
    monkeypatch.setenv(maven.REPOSITORY_ENV, str(_cache_without(tmp_path, missing)))
    with pytest.raises(ArtifactUnavailableError) as raised:
        maven.resolve(missing)
    message = str(raised.value)
    assert "\n" not in message and missing.coordinates in message and "ICEBARRIER_TEST_NONE_JAR" in message
    assert "mvn could not fetch it" in message
