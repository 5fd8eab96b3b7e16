"""A real `icebarrier serve` process on a free port, and a pipeline of root jobs writing lake
tables through PyIceberg, for the catalog tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid

import psutil
import pyarrow as pa
import requests
from prometheus_client.parser import text_string_to_metric_families
from pyiceberg.catalog.rest import RestCatalog

from icebarrier.control_plane import barriers, jobs, leases
from icebarrier.control_plane.model import JobDefinition
from icebarrier.iceberg_ext.catalog import SUMMARY_BARRIER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    lake, *extra: str, env_extra: dict | None = None, cwd=None, port: int | None = None
) -> tuple[subprocess.Popen, str]:
    """Serve on ``port`` (else a free one) and wait until this process listens there. A free port
    can be taken by another process (a Spark JVM, another worker's server) before the server
    binds it: an answer on the port is not enough. Without a fixed port, such a start is tried
    again on another one."""
    for _ in range(5):
        chosen = port or free_port()
        env = {
            **os.environ,
            "ICEBARRIER_DSN": lake.settings.dsn,
            "ICEBARRIER_SCHEMA": lake.settings.schema,
            "ICEBARRIER_WAREHOUSE": lake.settings.warehouse,
            **(env_extra or {}),
        }
        proc = subprocess.Popen(
            ["icebarrier", "serve", "--port", str(chosen), *extra], env=env, stderr=subprocess.PIPE, text=True, cwd=cwd
        )
        deadline = time.monotonic() + 60
        while proc.poll() is None and not _listens(proc.pid, chosen):
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        if proc.poll() is None:
            return proc, f"http://127.0.0.1:{chosen}"
        err = proc.stderr.read()
        assert port is None and "address already in use" in err, err
    raise AssertionError("the server found no free port in 5 tries")


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` (or a child: --workers) listens on ``port``."""
    try:
        parent = psutil.Process(pid)
        procs = [parent, *parent.children(recursive=True)]
        return any(
            c.status == psutil.CONN_LISTEN and c.laddr.port == port for p in procs for c in p.net_connections("tcp")
        )
    except psutil.NoSuchProcess:
        return False


def worker_pids(supervisor: int) -> set[int]:
    """The worker processes of `serve --workers` (the supervisor's spawned children, not the
    helper multiprocessing starts beside them)."""
    pids = set()
    for child in psutil.Process(supervisor).children():
        try:
            if not any("resource_tracker" in part for part in child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:  # it exited meanwhile
            pass
    return pids


def stop_server(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[1]


class Pipeline:
    """Root jobs writing lake tables through PyIceberg, barrier by barrier (tagged, recorded)."""

    def __init__(self, lake, names: dict[str, list[str]]) -> None:
        self.lake, self.tables, self.marks = lake, {}, []
        schema = pa.schema([("id", pa.int64()), ("barrier", pa.int64())])
        for job, sinks in names.items():
            jobs.register(
                lake.conn,
                JobDefinition(
                    name=f"{lake.namespace}_{job}",
                    sinks=frozenset(lake.T(s) for s in sinks),
                    external_inputs=frozenset([f"ext:{job}"]),
                ),
            )
            for s in sinks:
                self.tables[s] = (
                    f"{lake.namespace}_{job}",
                    lake.catalog.create_table(f"{lake.namespace}.{s}", schema=schema),
                )

    def advance(self, rows: int = 1, only: set[str] | None = None) -> int:
        b = barriers.issue(self.lake.conn).barrier
        self.marks.append(b)
        by_job: dict[str, dict] = {}
        for name, (job, _) in self.tables.items():
            if only is None or job in only:
                table = self.lake.catalog.load_table(f"{self.lake.namespace}.{name}")
                table.append(
                    pa.table({"id": list(range(rows)), "barrier": [b] * rows}),
                    snapshot_properties={SUMMARY_BARRIER: str(b)},
                )
                by_job.setdefault(job, {})[self.lake.T(name)] = table.current_snapshot().snapshot_id
        for job, commits in by_job.items():
            jobs.complete(self.lake.conn, job, b, commits)
        return b


def every_warehouse(lake, marks: list[int], rows: int = 10) -> dict[str, int]:
    """Each warehouse and the rows ``orders`` (of a Pipeline with orders and payments that wrote
    ``rows`` a barrier at ``marks``) has through it; the lease pins the second barrier."""
    lease = leases.acquire(lake.conn, [lake.T("orders"), lake.T("payments")], ttl_s=600, holder="t", barrier=marks[1])
    every = rows * len(marks)
    return {
        "latest": every,
        "read-committed": every,
        f"read-committed:{lake.namespace}": every,
        **{f"barrier-{b}": rows * (i + 1) for i, b in enumerate(marks)},
        f"lease-{lease.lease_id}": rows * 2,
    }


def rest(uri: str, warehouse: str, credential: str, **properties: str) -> RestCatalog:
    """PyIceberg's REST catalog through ``warehouse`` (``properties``: more of its own, e.g.
    ``{"scan-planning-mode": "server"}``)."""
    return RestCatalog(
        f"rest_{uuid.uuid4().hex[:6]}",
        uri=uri,
        warehouse=warehouse,
        credential=credential,
        **{"oauth2-server-uri": f"{uri}/v1/oauth/tokens", **properties},
    )


def spark_catalog(spark, warehouse: str, uri: str, credential: str, **properties: str) -> str:
    """A catalog of a fresh name in the running Spark session, as ``icebarrier connect --engine
    spark`` configures it (and ``properties``: more of its own, e.g. ``scan-planning-mode``); its name."""
    from icebarrier.apps.catalog.clients import configuration

    name = f"c_{uuid.uuid4().hex[:8]}"
    for line in configuration("spark", warehouse, uri, credential, name).splitlines():
        key, value = line.split(" ", 1)
        if key.startswith(f"spark.sql.catalog.{name}"):
            spark.conf.set(key, value)
    for key, value in properties.items():
        spark.conf.set(f"spark.sql.catalog.{name}.{key}", value)
    return name


def access_token(uri: str, client_id: str, secret: str) -> str:
    r = requests.post(
        f"{uri}/v1/oauth/tokens",
        data={"grant_type": "client_credentials", "client_id": client_id, "client_secret": secret},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()["access_token"]


def staged_change(catalog, name: str, barrier: int | None):
    """A PyIceberg transaction appending one row (tagged ``barrier``), not committed: its change."""
    from pyiceberg.catalog.rest import CommitTableRequest
    from pyiceberg.table import TableIdentifier

    table = catalog.load_table(name)
    tx = table.transaction()
    tx.append(
        pa.table({"id": [1], "barrier": [barrier or 0]}),
        snapshot_properties={SUMMARY_BARRIER: str(barrier)} if barrier is not None else {},
    )
    namespace, _, table_name = name.rpartition(".")
    return CommitTableRequest(
        identifier=TableIdentifier(namespace=[namespace], name=table_name),
        requirements=tx._requirements,
        updates=tx._updates,
    )


def scrape(server: str, headers: dict, params: dict | None = None) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics (``params``: its query, e.g. the tables to give series of):
    (name, sorted labels) -> value."""
    r = requests.get(f"{server}/metrics", headers=headers, params=params, timeout=30)
    assert r.status_code == 200, r.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }
