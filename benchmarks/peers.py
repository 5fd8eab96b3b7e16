"""icebarrier beside the catalogs people run today, measured in one run on this machine.

    python benchmarks/peers.py [--dsn DSN] [--tables 1000] [--seconds 10] [--commits 50]
                               [--beside 0] [--peers iceberg-rest,nessie] [--workers 2] [--json FILE]

The peers, installed from Maven Central (pinned, cached, checksums verified) and started here,
each with Postgres as its store:

- ``iceberg-rest``: Apache Iceberg's reference REST server (``RESTCatalogServer``, the
  ``iceberg-open-api`` test fixtures that Iceberg's apache/iceberg-rest-fixture image runs), on a
  JDBC catalog in Postgres, a local warehouse; its classpath is ``peers/iceberg-rest/pom.xml``.
- ``nessie``: Nessie's Quarkus runner, its Iceberg REST API, the JDBC version store in Postgres.
  Nessie's catalog writes only to object storage, so its warehouse is on S3: SeaweedFS on
  127.0.0.1 (``tests/seaweedfs.py``, built once from Go's module proxy; moto's server broke a
  Nessie run, an INTERNAL_FAILURE inside a 200 to CompleteMultipartUpload); it needs Java 21
  (the Temurin JDK under /usr/lib/jvm).

Apache Polaris and Gravitino are not on Maven Central as runnable servers (Docker images and
tarballs on Apache's download site only), so they are not run.

The same workload for each, in one run: create ``--tables`` tables (and append one row to each,
not timed); load p50/p99 from one client; loads/s from 4 and 16 concurrent clients (``wrk``, a
C load generator, one keep-alive connection per client, two threads; its CPU is measured and
printed); a PyIceberg append's p50 (one row, ``--commits`` of them); ``list tables`` of the
namespace of ``--tables``. With ``--beside N`` each catalog holds N other tables first (namespace
``beside``), put there in bulk (rows of the SQL catalogs' pointer tables; commits of 1,000 puts
through Nessie's API; never loaded), so every measure is taken in a lake of N more tables
without an hour of creates per catalog. icebarrier runs twice: through ``latest`` and through
``read-committed`` (every load pinned at the client's session moment, 16 reader tokens rotated);
for each, from its processes' ``/metrics``, their garbage-collector pauses and their own loads of
10 ms or more while ``wrk`` measured (after its warm-up): where a load p99 comes from.
It prints one table, peer × measure, and each peer ÷ icebarrier.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.seaweedfs: the tests' object store

from catalog import start  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import barriers, db, jobs, tokens  # noqa: E402
from icebarrier.control_plane.model import JobDefinition, TableName  # noqa: E402
from icebarrier.iceberg_ext import catalog as ib_catalog  # noqa: E402
from icebarrier.iceberg_ext import maven  # noqa: E402
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402

PEERS_DIR = Path(__file__).resolve().parent / "peers"
NESSIE = maven.Artifact(
    title="Nessie's server (Quarkus runner)",
    group="org.projectnessie.nessie",
    artifact="nessie-quarkus",
    version="0.99.0",  # the newest runner on Maven Central (later ones are on GitHub only)
    classifier="runner",
    sha256="ce9fa33e2878bf5ea3981876b9e6204cabc0362b3dd82326b10e47271a78c417",
    env="ICEBARRIER_NESSIE_JAR",
)
SCHEMA = pa.schema([("id", pa.int64())])
ROW = pa.table({"id": [1]})
NOT_RUN = {
    "polaris": "not on Maven Central as a runnable server (Docker images and a binary tarball on "
    "Apache's download site; this machine reaches registries only)",
    "gravitino": "its Iceberg REST server is not on Maven Central as a runnable artifact (Docker "
    "images and a tarball on Apache's download site)",
}


@dataclass
class Target:
    """A running catalog, as the workload sees it."""

    name: str
    uri: str  # the catalog URI a client is given
    properties: dict[str, str]  # PyIceberg's RestCatalog properties beside uri
    load_path: str  # a load's path on the server, "{table}" for the table's name
    tokens: list[str] = field(default_factory=list)  # bearer tokens, rotated by the load generator
    storage: str = "local files"
    beside: Callable[[int], None] | None = None  # puts N tables in namespace beside, in bulk

    @property
    def origin(self) -> str:
        return re.match(r"https?://[^/]+", self.uri).group(0)

    def catalog(self):
        from pyiceberg.catalog.rest import RestCatalog

        return RestCatalog(self.name, uri=self.uri, **self.properties)


# -- the workload ------------------------------------------------------------------------------


def create_tables(catalog, n: int) -> float:
    """Seconds to create ``n`` tables in namespace bench, one after another."""
    catalog.create_namespace_if_not_exists("bench")
    started = time.perf_counter()
    for i in range(n):
        catalog.create_table(f"bench.t{i}", schema=SCHEMA)
    return time.perf_counter() - started


BESIDE = "beside"  # the namespace of --beside's tables


def beside_in_sql(dsn: str, tables: str, catalog_name: str, n: int, root: str) -> None:
    """``n`` tables in namespace beside as rows of a SQL catalog's pointer table ``tables`` (its
    qualified name), in one statement, each pointer of the form every writer gives it (no
    metadata file is written: these tables are never loaded)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {tables} (catalog_name, table_namespace, table_name, metadata_location) "
            f"SELECT %s, %s, 'o' || i, %s || '/o' || i || '/metadata/00000-beside.metadata.json' "
            f"FROM generate_series(1, %s) i",
            (catalog_name, BESIDE, f"{root}/{BESIDE}", n),
        )


def beside_in_nessie(api: str, n: int, root: str, *, batch: int = 1000) -> None:
    """``n`` tables in namespace beside through Nessie's own API: commits of ``batch`` puts each."""
    for first in range(0, n, batch):
        head = requests.get(f"{api}/trees/main", timeout=30).json()["reference"]["hash"]
        operations = [
            {
                "type": "PUT",
                "key": {"elements": [BESIDE, f"o{i}"]},
                "content": {
                    "type": "ICEBERG_TABLE",
                    "metadataLocation": f"{root}/{BESIDE}/o{i}/metadata/00000-beside.metadata.json",
                    "snapshotId": -1,
                    "schemaId": 0,
                    "specId": 0,
                    "sortOrderId": 0,
                },
            }
            for i in range(first + 1, min(n, first + batch) + 1)
        ]
        done = requests.post(
            f"{api}/trees/main@{head}/history/commit",
            json={"commitMeta": {"message": "tables beside"}, "operations": operations},
            timeout=300,
        )
        if done.status_code != 200:
            raise SystemExit(f"Nessie refused the tables beside: {done.status_code} {done.text[:500]}")


def append_one_row(catalog, n: int) -> None:
    """One snapshot in each table (a load then returns a table with data, as in use)."""
    for i in range(n):
        catalog.load_table(f"bench.t{i}").append(ROW)


def commit_p50(catalog, n: int, namespace: str = "free") -> float:
    """p50 ms of a PyIceberg append of one row to a new table through ``catalog``."""
    catalog.create_namespace_if_not_exists(namespace)
    table = catalog.create_table(f"{namespace}.commits", schema=SCHEMA)
    table.append(ROW)  # warm
    times = []
    for _ in range(n):
        started = time.perf_counter()
        table.append(ROW)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def list_p50(catalog, n_tables: int, n: int = 20) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        found = catalog.list_tables("bench")
        times.append((time.perf_counter() - started) * 1000)
        if len(found) < n_tables:
            raise SystemExit(f"list tables returned {len(found)} of {n_tables}")
    return statistics.median(times)


WRK_SCRIPT = """
local paths = {%(paths)s}
local auths = {%(auths)s}
local n = 0
request = function()
  n = n + 1
  local headers = {}
  if #auths > 0 then headers["Authorization"] = "Bearer " .. auths[n %% #auths + 1] end
  return wrk.format("GET", paths[n %% #paths + 1], headers)
end
"""


@dataclass
class Wrk:
    rate: float  # requests/s
    p50_ms: float
    p99_ms: float
    client_cores: float  # wrk's CPU time ÷ wall time


def wrk(target: Target, n_tables: int, *, clients: int, seconds: float, work: Path) -> Wrk:
    """``clients`` keep-alive connections loading the tables in turn for ``seconds``."""
    exe = shutil.which("wrk")
    if exe is None:
        raise SystemExit("wrk is not installed: apt-get install wrk")
    script = work / f"load-{target.name.replace(' ', '_')}.lua"
    script.write_text(
        WRK_SCRIPT
        % {
            "paths": ",".join(json.dumps(target.load_path.format(table=f"t{i}")) for i in range(n_tables)),
            "auths": ",".join(json.dumps(t) for t in target.tokens),
        }
    )
    threads = min(clients, 2)
    proc = subprocess.Popen(
        [exe, f"-t{threads}", f"-c{clients}", f"-d{round(seconds)}s", "--latency", "-s", str(script), target.origin],
        stdout=subprocess.PIPE,
        text=True,
    )
    started = time.perf_counter()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    out = proc.stdout.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or "Non-2xx" in out or "Socket errors" in out:
        raise SystemExit(f"wrk against {target.name} failed:\n{out}")
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    return Wrk(
        rate=rate,
        p50_ms=_ms(re.search(r"\s50%\s+([\d.]+\w+)", out).group(1)),
        p99_ms=_ms(re.search(r"\s99%\s+([\d.]+\w+)", out).group(1)),
        client_cores=(usage.ru_utime + usage.ru_stime) / wall,
    )


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def measure_loads(target: Target, args, work: Path, warmed: Callable[[], None] = lambda: None) -> dict[str, float]:
    wrk(target, args.tables, clients=4, seconds=3, work=work)  # warm: JIT, caches, pinned files
    warmed()
    one = wrk(target, args.tables, clients=1, seconds=args.seconds, work=work)
    four = wrk(target, args.tables, clients=4, seconds=args.seconds, work=work)
    sixteen = wrk(target, args.tables, clients=16, seconds=args.seconds, work=work)
    return {
        "load p50 ms": one.p50_ms,
        "load p99 ms": one.p99_ms,
        "loads/s, 4 clients": four.rate,
        "loads/s, 16 clients": sixteen.rate,
        "wrk CPU (cores), 4 / 16 clients": f"{four.client_cores:.2f} / {sixteen.client_cores:.2f}",
    }


def measure_catalog(target: Target, args, *, created_s: float | None = None) -> dict[str, float]:
    catalog = target.catalog()
    if created_s is None:
        created_s = create_tables(catalog, args.tables)
        append_one_row(catalog, args.tables)
    return {
        f"create {args.tables} tables, s": created_s,
        "append p50 ms": commit_p50(catalog, args.commits),
        f"list {args.tables} tables ms": list_p50(catalog, args.tables),
    }


# -- the peers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} before it served")
        try:
            if requests.get(url, timeout=1).status_code < 500:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what} did not serve {url} within {timeout_s:.0f} s")


@contextlib.contextmanager
def running(command: list[str], env: dict, log: Path) -> Iterator[subprocess.Popen]:
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def jdbc(dsn: str) -> tuple[str, str, str]:
    """(JDBC URL, user, password) of a libpq DSN."""
    import psycopg

    info = psycopg.conninfo.conninfo_to_dict(dsn)
    url = f"jdbc:postgresql://{info.get('host', '127.0.0.1')}:{info.get('port', 5432)}/{info['dbname']}"
    return url, str(info.get("user", "postgres")), str(info.get("password", "unused"))


def reference_classpath() -> str:
    """The reference server's classpath, resolved by Maven from peers/iceberg-rest/pom.xml (once;
    cached in the local repository; -C: a file whose checksum differs from the repository's fails)."""
    out = Path(tempfile.mkdtemp()) / "classpath.txt"
    done = subprocess.run(
        [shutil.which("mvn") or "mvn", "-B", "-q", "-C", f"-Dmaven.repo.local={maven.repository()}"]
        + ["dependency:build-classpath", f"-Dmdep.outputFile={out}"],
        cwd=PEERS_DIR / "iceberg-rest",
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"mvn could not resolve the reference server:\n{done.stdout[-2000:]}{done.stderr[-1000:]}")
    return out.read_text().strip()


@contextlib.contextmanager
def iceberg_rest(dsn: str, work: Path) -> Iterator[Target]:
    url, user, password = jdbc(dsn)
    port = free_port()
    env = {
        **os.environ,
        "CATALOG_URI": url,
        "CATALOG_JDBC_USER": user,
        "CATALOG_JDBC_PASSWORD": password,
        "CATALOG_WAREHOUSE": (work / "iceberg-rest-wh").as_uri(),
        "CATALOG_REST_PORT": str(port),
    }
    command = ["java", "-cp", reference_classpath(), "org.apache.iceberg.rest.RESTCatalogServer"]
    with running(command, env, work / "iceberg-rest.log") as proc:
        uri = f"http://127.0.0.1:{port}"
        wait_http(f"{uri}/v1/config", proc, "the reference REST server")
        target = Target("iceberg-rest", uri, {}, "/v1/namespaces/bench/tables/{table}")

        def beside(n: int) -> None:  # its JDBC catalog's rows, in the database's public schema
            target.catalog().create_namespace(BESIDE)
            beside_in_sql(dsn, "iceberg_tables", _jdbc_catalog_name(dsn), n, env["CATALOG_WAREHOUSE"])

        target.beside = beside
        yield target


def _jdbc_catalog_name(dsn: str) -> str:
    import psycopg

    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT catalog_name FROM iceberg_namespace_properties WHERE namespace = %s LIMIT 1", (BESIDE,)
        ).fetchone()[0]


def java_21() -> str:
    """A java of version 21 or newer (Nessie 0.99 is built for Java 21)."""
    for home in [os.environ.get("JAVA_HOME", ""), *sorted(glob.glob("/usr/lib/jvm/*"), reverse=True)]:
        release = Path(home, "release")
        if release.is_file():
            found = re.search(r'JAVA_VERSION="(\d+)', release.read_text())
            if found and int(found.group(1)) >= 21:
                return str(Path(home, "bin", "java"))
    raise SystemExit("Nessie needs Java 21 or newer: install one or set JAVA_HOME to it")


@contextlib.contextmanager
def nessie(dsn: str, work: Path) -> Iterator[Target]:
    from tests.seaweedfs import ADMIN_KEY, ADMIN_SECRET, BUCKET, REGION, seaweed

    jar = maven.resolve(NESSIE)
    url, user, password = jdbc(dsn)
    port = free_port()
    with seaweed(work / "seaweedfs") as s3:
        properties = {
            "quarkus.http.port": port,
            "quarkus.management.port": free_port(),
            "quarkus.log.level": "WARN",
            "nessie.version.store.type": "JDBC2",
            "nessie.version.store.persist.jdbc.datasource": "postgresql",
            "quarkus.datasource.postgresql.jdbc.url": url,
            "quarkus.datasource.postgresql.username": user,
            "quarkus.datasource.postgresql.password": password,
            "nessie.catalog.default-warehouse": "wh",
            "nessie.catalog.warehouses.wh.location": f"s3://{BUCKET}/nessie",
            "nessie.catalog.service.s3.default-options.endpoint": f"{s3.endpoint}/",
            "nessie.catalog.service.s3.default-options.path-style-access": "true",
            "nessie.catalog.service.s3.default-options.region": REGION,
            "nessie.catalog.service.s3.default-options.access-key": "urn:nessie-secret:quarkus:s3key",
            "s3key.name": ADMIN_KEY,
            "s3key.secret": ADMIN_SECRET,
        }
        command = [java_21(), *(f"-D{k}={v}" for k, v in properties.items()), "-jar", str(jar)]
        with running(command, dict(os.environ), work / "nessie.log") as proc:
            uri = f"http://127.0.0.1:{port}/iceberg"
            wait_http(f"{uri}/v1/config", proc, "Nessie")
            prefix = requests.get(f"{uri}/v1/config", timeout=10).json()["defaults"]["prefix"]
            client = {
                "s3.endpoint": s3.endpoint,
                "s3.access-key-id": ADMIN_KEY,
                "s3.secret-access-key": ADMIN_SECRET,
                "s3.region": REGION,
                "s3.path-style-access": "true",
            }
            target = Target(
                "nessie",
                uri,
                client,
                f"/iceberg/v1/{prefix}/namespaces/bench/tables/{{table}}",
                storage="S3 (SeaweedFS)",
            )

            def beside(n: int) -> None:
                target.catalog().create_namespace(BESIDE)
                beside_in_nessie(f"http://127.0.0.1:{port}/api/v2", n, f"s3://{BUCKET}/nessie")

            target.beside = beside
            yield target


# -- icebarrier --------------------------------------------------------------------------------


def icebarrier(args, dsn: str, work: Path) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(catalog measures, loads through latest, loads through read-committed)."""
    settings = Settings(dsn=dsn, warehouse=str(work / "icebarrier-wh")).validated()
    ib_catalog.upgrade(settings)
    if args.beside:  # rows of its SQL catalog, placed as `db upgrade` places a catalog written before
        beside_in_sql(
            dsn, f"{settings.catalog_schema}.iceberg_tables", settings.catalog, args.beside, settings.warehouse
        )
        ib_catalog.watch_pointers(settings)
    names = [TableName.parse(f"lake.bench.t{i}") for i in range(args.tables)]
    with db.connect(dsn) as conn:
        jobs.register(conn, JobDefinition(name="bench", sinks=frozenset(names), external_inputs=frozenset(["x"])))
        writer = tokens.create(conn, job="bench", whole_lake=True)
        readers = [tokens.create(conn, whole_lake=True) for _ in range(16)]
    proc, uri = start(settings, workers=args.workers)
    try:
        served = Target("icebarrier", uri, {"warehouse": "latest", "credential": ":".join(writer)}, "")
        created_s = create_tables(served.catalog(), args.tables)
        # one row in each, committed at a barrier as a job does (the SQL catalog directly: the
        # server's commit path is measured by the append p50)
        direct = ib_catalog.load_catalog(settings)
        with db.connect(dsn) as conn:
            b = barriers.issue(conn).barrier
            commits = {}
            for name in names:
                table = direct.load_table(f"bench.{name.name}")
                table.append(ROW, snapshot_properties={SUMMARY_BARRIER: str(b)})
                commits[name] = table.current_snapshot().snapshot_id
            jobs.complete(conn, "bench", b, commits)
        measures = measure_catalog(served, args, created_s=created_s)
        # the same append through PyIceberg's SQL catalog on the control-plane database, directly
        measures["append p50 ms, PyIceberg's SQL catalog"] = commit_p50(direct, args.commits, "direct")
        access = [access_token(uri, reader) for reader in readers]
        loads = {}
        for warehouse in ("latest", "read-committed"):
            target = Target("icebarrier", uri, {}, f"/v1/{warehouse}/namespaces/bench/tables/{{table}}", access)
            before = []  # once warm: the measured windows only

            def warmed(before=before) -> None:
                before += server_histograms(uri, access[0], args.workers)

            loads[warehouse] = measure_loads(target, args, work, warmed)
            loads[warehouse] |= slow_between(before, server_histograms(uri, access[0], args.workers))
        return measures, loads["latest"], loads["read-committed"]
    finally:
        proc.terminate()
        proc.wait(30)


SLOW = {  # the server's histograms a benchmark window's p99 can be traced to, and what is slow in each
    "icebarrier_catalog_gc_pause_seconds": ("GC pauses ≥ 10 ms while loading", 0.01),
    "icebarrier_catalog_load_seconds": ("loads ≥ 10 ms inside the server", 0.01),
}


def server_histograms(uri: str, token: str, workers: int) -> list[dict[str, dict[float, float]]]:
    """Each server process's :data:`SLOW` histograms so far, as cumulative buckets (seconds:
    count, label sets summed), from its ``/metrics``: one connection per process, each kept open
    while the next is made (the server hands a new connection to the process that holds fewest)."""
    from prometheus_client.parser import text_string_to_metric_families

    sessions = [requests.Session() for _ in range(workers)]
    found = []
    try:
        for session in sessions:
            text = session.get(f"{uri}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30).text
            histograms: dict[str, dict[float, float]] = {name: {} for name in SLOW}
            for family in text_string_to_metric_families(text):
                for sample in family.samples if family.name in SLOW else ():
                    if sample.name.endswith("_bucket"):
                        buckets = histograms[family.name]
                        le = float(sample.labels["le"])
                        buckets[le] = buckets.get(le, 0) + sample.value
            found.append(histograms)
    finally:
        for session in sessions:
            session.close()
    return found


def slow_between(before: list[dict], after: list[dict]) -> dict[str, str]:
    """What was slow between two :func:`server_histograms`: how many, and the bound of the slowest.
    A GC pause holds every answer of its process; a slow load is one request's own time. Either is
    what a load's p99 meets."""
    slow = {}
    for name, (measure, over_s) in SLOW.items():
        bounds = set().union(*(a[name] for a in after))  # a histogram with no sample yet has no buckets
        between = {
            le: sum(a[name].get(le, 0) - b[name].get(le, 0) for a, b in zip(after, before, strict=True))
            for le in bounds
        }
        total = between[float("inf")]
        slowest = min(le for le, n in between.items() if n == total)
        slow[measure] = f"{total - between[over_s]:g} (slowest ≤ {slowest * 1000:g} ms)"
    return slow


def access_token(uri: str, credential: tuple[str, str]) -> str:
    r = requests.post(
        f"{uri}/v1/oauth/tokens",
        data={"grant_type": "client_credentials", "client_id": credential[0], "client_secret": credential[1]},
        timeout=10,
    )
    r.raise_for_status()
    return r.json()["access_token"]


# -- the table ---------------------------------------------------------------------------------

LOWER_IS_BETTER = ("ms", ", s")


def table(columns: dict[str, dict]) -> str:
    rows = list(dict.fromkeys(k for c in columns.values() for k in c))
    width = max(map(len, rows)) + 2
    lines = ["".ljust(width) + "".join(f"{name:>27}" for name in columns)]
    for row in rows:
        cells = []
        for values in columns.values():
            v = values.get(row, "")
            cells.append(f"{v:>27.2f}" if isinstance(v, float) else f"{v!s:>27}")
        lines.append(row.ljust(width) + "".join(cells))
    ours = columns["icebarrier latest"]
    lines.append("")
    lines.append(
        "each peer ÷ icebarrier latest (> 1: icebarrier is better; latency and time: peer ÷ ours, rates: ours ÷ peer)"
    )
    for name, values in columns.items():
        if name.startswith("icebarrier"):
            continue
        for row in rows:
            a, b = values.get(row), ours.get(row)
            if isinstance(a, float) and isinstance(b, float) and a and b:
                better = a / b if row.endswith(LOWER_IS_BETTER) else b / a
                lines.append(f"  {name:>14}  {row:<{width}} {better:6.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=DEFAULT_SERVER)
    parser.add_argument("--tables", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10, help="each load measurement")
    parser.add_argument("--commits", type=int, default=50)
    parser.add_argument(
        "--beside", type=int, default=0, help="tables each catalog holds already (namespace beside, put in bulk)"
    )
    parser.add_argument("--peers", default="iceberg-rest,nessie")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="`icebarrier serve --workers`")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    peers = {"iceberg-rest": iceberg_rest, "nessie": nessie}
    chosen = [p for p in args.peers.split(",") if p]
    unknown = [p for p in chosen if p not in peers]
    if unknown:
        raise SystemExit(f"unknown peer {unknown[0]}: choose from {', '.join(peers)}")
    columns: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with scratch_database(args.dsn) as dsn:
            measures, latest, committed = icebarrier(args, dsn, work)
        columns["icebarrier latest"] = {**latest, **measures, "storage": "local files", "tables beside": args.beside}
        columns["icebarrier read-committed"] = {**committed, "storage": "local files"}
        for name in chosen:
            with scratch_database(args.dsn) as dsn, peers[name](dsn, work) as target:
                print(f"{name}: measuring", file=sys.stderr)
                columns[name] = {
                    **measure_peer(target, args, work),
                    "storage": target.storage,
                    "tables beside": args.beside,
                }
    print(table(columns))
    for name, why in NOT_RUN.items():
        print(f"not run: {name}: {why}")
    if args.json:
        args.json.write_text(json.dumps(columns, indent=2))
    return 0


def measure_peer(target: Target, args, work: Path) -> dict:
    """A peer: its tables first (created, timed; one row each), then its loads and the rest."""
    if args.beside:
        target.beside(args.beside)
    catalog_measures = measure_catalog(target, args)
    return {**measure_loads(target, args, work), **catalog_measures}


if __name__ == "__main__":
    sys.exit(main())
