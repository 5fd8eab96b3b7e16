"""``icebarrier job exec`` overhead, against the same command run against ``latest`` directly in the
same run.

    python benchmarks/job_exec.py [--dsn DSN] [--rows 120000000] [--runs 3]

The command is a plain PySpark batch job (benchmarks/engines/spark_minute.py: hash ``--rows``
ids, aggregate, append; about a minute on 2 cores at the default). Each run pair, in turn:

- direct: the script with Spark configured for warehouse ``latest``, appending to an
  unmanaged table (what the job was before it joined the pipeline);
- exec: ``icebarrier job exec minute -- <the script>`` with the job's sink managed: session
  opened, sources/sinks through warehouse ``job:minute@<run>``, commit staged, barrier
  published.

The two alternate which goes first. Prints each pair's seconds and exec ÷ direct, worst first
(goal <= 1.1), and the catalog
requests of one exec run by kind (loads, commits, session calls), counted by the server.
It creates a scratch database and warehouse and an in-process ``icebarrier serve``, and removes
them.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.apps.catalog.clients import spark_conf  # noqa: E402
from icebarrier.control_plane import barriers, db, jobs, tokens  # noqa: E402
from icebarrier.control_plane.model import JobDefinition, TableName  # noqa: E402
from icebarrier.iceberg_ext.catalog import load_catalog, upgrade  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402
from icebarrier.iceberg_ext.spark import SPARK_LOG4J2  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "engines" / "spark_minute.py"


def kind(method: str, path: str) -> str:
    if path.startswith("/icebarrier/"):
        return "session"
    if path == "/v1/oauth/tokens":
        return "auth"
    if path == "/v1/config":
        return "config"
    if "/tables/" in path and not path.endswith("/metrics"):
        return {"GET": "load", "HEAD": "exists", "POST": "commit"}.get(method, method.lower())
    return "other"


def serve(settings: Settings) -> tuple[str, collections.Counter]:
    """An in-process `icebarrier serve` that counts requests by kind; its URI."""
    import uvicorn

    from icebarrier.apps.catalog.server import create_app

    app = create_app(settings)
    counts: collections.Counter = collections.Counter()

    @app.middleware("http")
    async def count(request, call_next):
        counts[kind(request.method, request.url.path)] += 1
        return await call_next(request)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", counts


def direct_env(uri: str, credential: str, workdir: Path) -> dict[str, str]:
    """Spark configured for warehouse latest, as a user would without icebarrier's sessions."""
    conf_dir = workdir / "spark-conf-direct"
    conf_dir.mkdir()
    conf = {"spark.ui.showConsoleProgress": "false", **spark_conf("latest", uri, credential, "lake")}
    (conf_dir / "spark-defaults.conf").write_text("".join(f"{k} {v}\n" for k, v in conf.items()))
    (conf_dir / "log4j2.properties").write_text(SPARK_LOG4J2)
    return {**os.environ, "SPARK_CONF_DIR": str(conf_dir), "ICEBARRIER_CATALOG": "lake"}


def timed(args: list[str], env: dict) -> float:
    started = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{args[:5]}… failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=DEFAULT_SERVER)
    parser.add_argument("--rows", type=int, default=120_000_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory(prefix="icebarrier-bench-") as tmp:
        settings = Settings(dsn=dsn, warehouse=str(Path(tmp) / "warehouse")).validated()
        upgrade(settings)  # what `icebarrier db upgrade` does before a server starts
        load_catalog(settings).create_namespace("bench")
        with db.connect(settings.dsn, settings.schema) as conn:
            jobs.register(
                conn,
                JobDefinition(
                    name="minute",
                    sinks=frozenset([TableName.parse("lake.bench.minute")]),
                    external_inputs=frozenset(["ext:minute"]),
                ),
            )
            credential = ":".join(tokens.create(conn, job="minute", whole_lake=True))
        uri, counts = serve(settings)
        direct = ["python3", str(SCRIPT), "bench.direct", str(args.rows)]
        exec_ = [
            "icebarrier",
            "job",
            "exec",
            "minute",
            "--catalog-uri",
            uri,
            "--credential",
            credential,
            "--",
            "python3",
            str(SCRIPT),
            "bench.minute",
            str(args.rows),
        ]
        env = direct_env(uri, credential, Path(tmp))
        pairs, requests = [], None
        for run in range(args.runs):
            with db.connect(settings.dsn, settings.schema) as conn:
                barriers.issue(conn)
            if run % 2:  # alternate which goes first (the first of a pair warms the page cache)
                counts.clear()
                e = timed(exec_, os.environ)
                d = timed(direct, env)
            else:
                d = timed(direct, env)
                counts.clear()
                e = timed(exec_, os.environ)
            requests = requests or dict(counts)
            pairs.append((e / d, d, e))
            print(f"run {run + 1}: direct {d:.1f} s, job exec {e:.1f} s, ratio {e / d:.3f}", flush=True)
        print("\nexec ÷ direct, worst first (goal <= 1.1):")
        for ratio, d, e in sorted(pairs, reverse=True):
            print(f"  {ratio:.3f}  (direct {d:.1f} s, exec {e:.1f} s)")
        print(
            f"\ncatalog requests of one exec run: {sum(requests.values())} "
            f"({', '.join(f'{k} {v}' for k, v in sorted(requests.items()))})"
        )


if __name__ == "__main__":
    main()
