"""A real Trino server for the tests and benchmarks: ``io.trino:trino-server`` from Maven Central
(pinned, cached and checksummed like Iceberg's jars: :mod:`icebarrier.iceberg_ext.maven`), on the
Temurin 25 JDK under /usr/lib/jvm (Trino 476 needs Java 24 or newer; the rest of the suite keeps
Java 17). Only the server's ``lib/``, ``bin/`` and the Iceberg plugin are unpacked (once, into the
cache), and a coordinator that is its own worker starts on 127.0.0.1 with the catalog files given.

    with trino_server(work_dir, {"lake": properties_text}) as trino:
        trino.query("SELECT count(*) FROM lake.ns.orders")
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from icebarrier.iceberg_ext import maven

TRINO_VERSION = "476"
TRINO_SERVER = maven.Artifact(
    title="Trino's server",
    group="io.trino",
    artifact="trino-server",
    version=TRINO_VERSION,
    packaging="tar.gz",
    sha256="cfd5accde17e8ebd251eeeb78aed1f490e77bb3a164d95a0f454bf8a7c1cbd3f",
    env="ICEBARRIER_TRINO_SERVER",
)
JAVA_HOME_ENV = "ICEBARRIER_TRINO_JAVA_HOME"
NODE_MAP_REFRESH_S = 5.5  # Trino's split scheduler refreshes its map of nodes every 5 s
PLUGINS = ("iceberg",)
JVM_CONFIG = """\
-server
-Xmx2G
-XX:+UseSerialGC
-XX:TieredStopAtLevel=1
-Djdk.attach.allowAttachSelf=true
-XX:+EnableDynamicAgentLoading
"""


def java_home() -> Path:
    """A JDK new enough for Trino: ``ICEBARRIER_TRINO_JAVA_HOME``, else the newest Temurin 24+."""
    if os.environ.get(JAVA_HOME_ENV):
        return Path(os.environ[JAVA_HOME_ENV])
    found = sorted(glob.glob("/usr/lib/jvm/temurin-2[4-9]-*"))
    if not found:
        raise RuntimeError(f"Trino {TRINO_VERSION} needs Java 24 or newer; set {JAVA_HOME_ENV} to such a JDK")
    return Path(found[-1])


def install() -> Path:
    """The unpacked server (``lib/``, ``bin/``, ``plugin/iceberg``), made once from the cached tarball."""
    tarball = maven.resolve(TRINO_SERVER)
    root = maven.repository() / ".icebarrier-unpacked"
    home = root / f"trino-server-{TRINO_VERSION}"
    if (home / ".complete").is_file():
        return home
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (home / ".complete").is_file():
            return home
        partial = root / f"{home.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        top = f"trino-server-{TRINO_VERSION}/"
        wanted = (f"{top}lib/", f"{top}bin/", *(f"{top}plugin/{p}/" for p in PLUGINS))
        with tarfile.open(tarball) as tar:
            members = [m for m in tar if m.name.startswith(wanted)]
            names = {m.name for m in members}
            # a hard link to a file outside what is unpacked (another plugin's copy) becomes a file
            outside = [m for m in members if m.islnk() and m.linkname not in names]
            for m in members:
                m.name = m.name[len(top) :]
                if m.islnk():
                    m.linkname = m.linkname[len(top) :]
            tar.extractall(partial, members=[m for m in members if m not in outside], filter="tar")
            for m in outside:
                with tar.extractfile(top + m.linkname) as src, open(partial / m.name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
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
    (etc / "node.properties").write_text(
        f"node.environment=test\nnode.id=icebarrier-{port}\nnode.data-dir={work_dir / 'data'}\n"
    )
    (etc / "jvm.config").write_text(JVM_CONFIG)
    (etc / "config.properties").write_text(
        f"coordinator=true\nnode-scheduler.include-coordinator=true\nhttp-server.http.port={port}\n"
        f"discovery.uri=http://127.0.0.1:{port}\nquery.max-memory=1GB\n"
        + ("catalog.management=dynamic\n" if dynamic else "")
    )
    for name, text in catalogs.items():
        (etc / "catalog" / f"{name}.properties").write_text(text)
    log = work_dir / "trino.log"
    jdk = java_home()
    env = {**os.environ, "JAVA_HOME": str(jdk), "PATH": f"{jdk}/bin:{os.environ['PATH']}"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(home / "bin" / "launcher"), "run", f"--etc-dir={etc}", f"--data-dir={work_dir / 'data'}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
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
