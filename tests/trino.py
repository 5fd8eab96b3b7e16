"""A real Trino server for the tests and benchmarks, assembled from the jars Maven Central serves:
Trino 483 is not published there as a server tarball, but its modules are. ``mvn`` copies
``trino-main`` and what it needs at run time into ``lib/``, and the Iceberg connector with what it
needs beyond the server's SPI into ``plugin/iceberg/`` (its Hadoop file system into ``hdfs/``
there; ``tests/peer/trino/pom.xml``), once, into the Maven cache; the digest of every jar copied is
pinned here (:data:`ASSEMBLY_SHA256`). It runs on the Temurin 25 JDK under /usr/lib/jvm (Trino 483
needs Java 25; the rest of the suite keeps Java 17) as a coordinator that is its own worker on
127.0.0.1, with the catalog files given.

    with trino_server(work_dir, {"lake": properties_text}) as trino:
        trino.query("SELECT count(*) FROM lake.ns.orders")
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from icebarrier.iceberg_ext import maven

TRINO_VERSION = "483"
# SHA-256 of "<folder>/<jar> <jar's SHA-256>\n" for every jar mvn copies, sorted: the assembly pinned
ASSEMBLY_SHA256 = "7dc506091ccf4aee263f05417989df193ebac9e8789f3f801470bd9e43a1d823"
POM = Path(__file__).parent / "peer" / "trino" / "pom.xml"
# the pom's profiles -> where each copies to: the server; the Iceberg plugin; its Hadoop file system
# (file:// locations), which the plugin loads from a class loader of its own
PARTS = {"server": "lib", "iceberg": "plugin/iceberg", "hdfs": "plugin/iceberg/hdfs"}
# the tarball's plugin folder names its plugin in a services jar trino's build makes; so do we
PLUGIN_SERVICE = ("plugin/iceberg/icebarrier-services.jar", "io.trino.plugin.iceberg.IcebergPlugin")
# the tarball's trino-server-main (the main class and its Java check) is not served: this is its main
MAIN = (
    "public class TrinoMain { public static void main(String[] a) { "
    f'new io.trino.server.Server().start("{TRINO_VERSION}"); }} }}\n'
)
JAVA_HOME_ENV = "ICEBARRIER_TRINO_JAVA_HOME"
_ASSEMBLE_TIMEOUT_S = 1800  # 625 jars from Maven Central: 8 minutes here from an empty Maven cache
NODE_MAP_REFRESH_S = 5.5  # Trino's split scheduler refreshes its map of nodes every 5 s
JVM_OPTIONS = (
    "-Xmx2G",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "--add-modules=jdk.incubator.vector",  # Trino 483 refuses to start without the Vector API
    "-Djdk.attach.allowAttachSelf=true",
    "-XX:+EnableDynamicAgentLoading",
)


def java_home() -> Path:
    """A JDK new enough for Trino: ``ICEBARRIER_TRINO_JAVA_HOME``, else the newest Temurin 25+."""
    if os.environ.get(JAVA_HOME_ENV):
        return Path(os.environ[JAVA_HOME_ENV])
    found = sorted(glob.glob("/usr/lib/jvm/temurin-2[5-9]-*"))
    if not found:
        raise RuntimeError(f"Trino {TRINO_VERSION} needs Java 25 or newer; set {JAVA_HOME_ENV} to such a JDK")
    return Path(found[-1])


def assembly_digest(home: Path) -> str:
    """The digest :data:`ASSEMBLY_SHA256` pins: every jar mvn copied, by folder, name and content."""
    lines = []
    for folder in PARTS.values():
        for jar in sorted((home / folder).glob("*.jar")):
            if jar.name != Path(PLUGIN_SERVICE[0]).name:
                lines.append(f"{folder}/{jar.name} {hashlib.sha256(jar.read_bytes()).hexdigest()}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def install() -> Path:
    """The assembled server (``lib/``, ``plugin/iceberg/``, ``TrinoMain.java``), made once in the
    Maven cache; raises if mvn fails or what it copied is not what is pinned."""
    root = maven.repository() / ".icebarrier-unpacked"
    home = root / f"trino-{TRINO_VERSION}-assembled"
    if (home / ".complete").is_file():
        return home
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (home / ".complete").is_file():
            return home
        partial = root / f"{home.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        mvn = shutil.which("mvn")
        if mvn is None:
            raise RuntimeError(
                f"Trino {TRINO_VERSION} is assembled by mvn, which is not installed (apt-get install maven)"
            )
        for profile, folder in PARTS.items():  # -C: a jar whose checksum differs from Central's fails
            done = subprocess.run(
                [mvn, "-B", "-q", "-C", f"-Dmaven.repo.local={maven.repository()}", "-f", str(POM), "-P", profile]
                + [f"-Dtrino.out={partial / folder}", "package"],
                capture_output=True,
                text=True,
                timeout=_ASSEMBLE_TIMEOUT_S,
            )
            if done.returncode != 0:
                raise RuntimeError(f"mvn could not assemble Trino {TRINO_VERSION} ({profile}): {done.stdout[-3000:]}")
        digest = assembly_digest(partial)
        if digest != ASSEMBLY_SHA256:
            raise RuntimeError(
                f"Trino {TRINO_VERSION}'s jars from Maven Central digest {digest}, not the pinned {ASSEMBLY_SHA256}"
            )
        with zipfile.ZipFile(partial / PLUGIN_SERVICE[0], "w") as services:
            services.writestr("META-INF/services/io.trino.spi.Plugin", PLUGIN_SERVICE[1] + "\n")
        (partial / "TrinoMain.java").write_text(MAIN)
        shutil.rmtree(home, ignore_errors=True)
        partial.rename(home)
        (home / ".complete").touch()
    return home


def connect(uri: str, credential: str, *, warehouse: str = "read-committed", catalog: str = "lake"):
    """`icebarrier connect --engine trino` run as an analyst would: the server's URI and a token,
    no DSN, no configuration file (no ICEBARRIER_* variable, run from /); the finished process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ICEBARRIER_")}
    return subprocess.run(
        [f"{os.path.dirname(sys.executable)}/icebarrier", "connect", "--engine", "trino", "--uri", uri]
        + ["--warehouse", warehouse, "--credential", credential, "--catalog", catalog],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd="/",
    )


def catalog_file(uri: str, warehouse: str, credential: str, catalog: str) -> str:
    """The catalog file `connect` prints for ``warehouse`` (raises if it refused)."""
    done = connect(uri, credential, warehouse=warehouse, catalog=catalog)
    if done.returncode != 0:
        raise RuntimeError(f"icebarrier connect --engine trino failed: {done.stderr}")
    return done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrinoError(RuntimeError):
    """A query Trino failed, with the chain of causes its client leaves out."""

    def __init__(self, error_name: str, message: str) -> None:
        super().__init__(f"{error_name}: {message}")
        self.error_name = error_name


def _causes(failure: dict | None) -> str:
    """The chain of causes of a Trino failure, innermost last (the client shows only the outermost)."""
    found = []
    while failure:
        found.append(f"{failure.get('type')}: {failure.get('message')}")
        failure = failure.get("cause")
    return " <- ".join(found[1:]) or "-"


@dataclass
class Trino:
    port: int
    log: Path
    active_since: float | None = None

    def connect(self, catalog: str | None = None, schema: str | None = None):
        import trino

        return trino.dbapi.connect(host="127.0.0.1", port=self.port, user="icebarrier", catalog=catalog, schema=schema)

    def ready(self) -> bool:
        """The node has announced itself, and the split scheduler has seen it: its map of nodes is
        refreshed every 5 s, so a query that scans a table can meet an empty map for that long
        after the node became active."""
        if self.active_since is None:
            if self.query("SELECT count(*) FROM system.runtime.nodes WHERE state = 'active'") != [[1]]:
                return False
            self.active_since = time.monotonic()
        return time.monotonic() > self.active_since + NODE_MAP_REFRESH_S

    @contextlib.contextmanager
    def catalogs(self, files: dict[str, str]) -> Iterator[None]:
        """``files`` (name -> the properties file text, as `icebarrier connect` prints it) as
        catalogs of this running Trino while the block runs (``CREATE CATALOG``, then ``DROP
        CATALOG``: a server started ``dynamic``), so that tests share one Trino."""
        made = []
        try:
            for name, text in files.items():
                properties = dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
                connector = properties.pop("connector.name")
                settings = ", ".join(f"\"{k}\" = '{v.replace(chr(39), chr(39) * 2)}'" for k, v in properties.items())
                self.query(f"CREATE CATALOG {name} USING {connector} WITH ({settings})")
                made.append(name)
            yield
        finally:
            for name in made:
                self.query(f"DROP CATALOG {name}")

    def query(self, sql: str, **where) -> list[list]:
        import trino

        cursor = self.connect(**where).cursor()
        try:
            cursor.execute(sql)
            return cursor.fetchall()
        except trino.exceptions.TrinoQueryError as exc:
            stack = " | ".join((exc.failure_info or {}).get("stack", [])[:12])
            raise TrinoError(
                exc.error_name, f"{exc.message}; caused by: {_causes(exc.failure_info)}; at {stack}"
            ) from None


@contextlib.contextmanager
def trino_server(
    work_dir: Path, catalogs: dict[str, str], *, dynamic: bool = False, timeout_s: float = 180
) -> Iterator[Trino]:
    """A running Trino with ``catalogs`` (name -> properties file text) in its etc/catalog
    (``dynamic``: ``CREATE CATALOG`` / ``DROP CATALOG`` allowed, catalog.management=dynamic)."""
    home = install()
    port = free_port()
    etc = work_dir / "etc"
    (etc / "catalog").mkdir(parents=True, exist_ok=True)
    (etc / "config.properties").write_text(
        f"coordinator=true\nnode-scheduler.include-coordinator=true\nhttp-server.http.port={port}\n"
        f"discovery.uri=http://127.0.0.1:{port}\nnode.internal-address=127.0.0.1\nquery.max-memory=1GB\n"
        f"plugin.dir={home / 'plugin'}\n" + ("catalog.management=dynamic\n" if dynamic else "")
    )
    for name, text in catalogs.items():
        (etc / "catalog" / f"{name}.properties").write_text(text)
    log = work_dir / "trino.log"
    jdk = java_home()
    env = {**os.environ, "JAVA_HOME": str(jdk), "PATH": f"{jdk}/bin:{os.environ['PATH']}"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(jdk / "bin" / "java"), *JVM_OPTIONS, "-Dnode.environment=test", f"-Dnode.id=icebarrier-{port}"]
            + [f"-Dnode.data-dir={work_dir / 'data'}", f"-Dconfig={etc / 'config.properties'}"]
            + ["-cp", f"{home / 'lib'}/*", str(home / "TrinoMain.java")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work_dir,  # etc/catalog is read from here
            start_new_session=True,
        )
    trino = Trino(port=port, log=log)
    try:
        deadline = time.monotonic() + timeout_s
        while "SERVER STARTED" not in log.read_text(errors="replace"):
            if proc.poll() is not None:
                raise RuntimeError(f"Trino exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Trino did not start in {timeout_s} s:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        while not trino.ready():  # started, then the node announces itself to the scheduler
            if time.monotonic() > deadline:
                raise RuntimeError(f"Trino started but runs no query in {timeout_s} s:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        yield trino
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


if __name__ == "__main__":  # python -m tests.trino: assemble it now (what .ci/run does before the tests)
    print(install(), file=sys.stderr)
