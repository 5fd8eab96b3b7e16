"""A catalog server on a network: its memory under a flood of large bodies, and what TLS costs a load.

    python benchmarks/serving.py [--dsn DSN] [--runs 3] [--clients 50] [--body-mb 100] [--loads 400]

Memory: ``--clients`` clients at once, each streams a ``--body-mb`` body (chunked: no length
declared, so the server must count it) as a commit of a table; once each with a job token of its
own (the server reads each body up to ``--max-body``, 8 MB, then answers 413), once without a
token (401 before a byte is read). The server's resident memory is sampled every 20 ms from
before a flood to its end: the peak above rest is what the flood costs. None may be answered
anything else (no 5xx).

TLS: one lake, two servers on it (plain http, and https with a certificate from a test CA); the
same client (``requests``, keep-alive) loads a table ``--loads`` times from each, in alternating
blocks. Goal: p50 with TLS ÷ without <= 1.1.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from catalog import start  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.control_plane import db, jobs, tokens  # noqa: E402
from icebarrier.control_plane.model import JobDefinition, TableName  # noqa: E402
from icebarrier.iceberg_ext.catalog import load_catalog, upgrade  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402

CHUNK = b"x" * (1 << 20)


def token(uri: str, credential: tuple[str, str], verify=True) -> str:
    r = requests.post(
        f"{uri}/v1/oauth/tokens",
        data={"grant_type": "client_credentials", "client_id": credential[0], "client_secret": credential[1]},
        verify=verify,
        timeout=30,
    )
    r.raise_for_status()
    return r.json()["access_token"]


def flood_one(port: int, bearer: str | None, body_mb: int, statuses: list) -> None:
    """Stream ``body_mb`` MB as a commit's body (chunked); the status the server answered."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {bearer}"} if bearer else {})}
    try:
        conn.request(
            "POST",
            "/v1/latest/namespaces/bench/tables/t",
            body=(CHUNK for _ in range(body_mb)),
            headers=headers,
            encode_chunked=True,
        )
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before the body ended: its answer is still to read
    try:
        statuses.append(conn.getresponse().status)
    except (ConnectionResetError, http.client.RemoteDisconnected, BrokenPipeError) as exc:
        statuses.append(type(exc).__name__)
    finally:
        conn.close()


def memory_under_flood(uri: str, pid: int, bearers: list[str | None], body_mb: int) -> dict:
    port = int(uri.rsplit(":", 1)[1])
    server = psutil.Process(pid)
    rest_rss = server.memory_info().rss
    peak, statuses, done = rest_rss, [], threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, server.memory_info().rss)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    clients = [threading.Thread(target=flood_one, args=(port, b, body_mb, statuses)) for b in bearers]
    started = time.monotonic()
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    seconds = time.monotonic() - started
    done.set()
    sampler.join()
    return {
        "rest_mb": rest_rss / 2**20,
        "peak_mb": peak / 2**20,
        "seconds": seconds,
        "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses), key=str)},
        "after_mb": server.memory_info().rss / 2**20,
    }


def tls_ratio(plain: str, https: str, ca: str, credential: tuple[str, str], loads: int) -> dict:
    times: dict[str, list[float]] = {"plain": [], "tls": []}
    sessions = {}
    for name, uri, verify in (("plain", plain, True), ("tls", https, ca)):
        s = requests.Session()
        s.headers["Authorization"] = f"Bearer {token(uri, credential, verify)}"
        sessions[name] = (s, uri, verify)  # verify per request: REQUESTS_CA_BUNDLE would beat a session's
    block = 50
    for _ in range(loads // block):
        for name, (s, uri, verify) in sessions.items():
            for _ in range(block):
                started = time.perf_counter()
                r = s.get(f"{uri}/v1/latest/namespaces/bench/tables/t", verify=verify)
                times[name].append((time.perf_counter() - started) * 1000)
                if r.status_code != 200:
                    raise SystemExit(f"a load through {name} answered {r.status_code}: {r.text[:200]}")
    p50 = {name: statistics.median(t) for name, t in times.items()}
    return {"plain_ms": p50["plain"], "tls_ms": p50["tls"], "ratio": p50["tls"] / p50["plain"]}


def one_run(args) -> dict:
    import pyarrow as pa
    import trustme

    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory(prefix="icebarrier-serving-") as home:
        settings = Settings(dsn=dsn, warehouse=str(Path(home) / "wh")).validated()
        upgrade(settings)  # what `icebarrier db upgrade` does before a server starts
        catalog = load_catalog(settings)
        catalog.create_namespace("bench")
        catalog.create_table("bench.t", schema=pa.schema([("n", pa.int64())]))
        with db.connect(dsn) as conn:
            jobs.register(
                conn,
                JobDefinition(
                    name="writer", sinks=frozenset([TableName.parse("lake.bench.t")]), external_inputs=frozenset(["x"])
                ),
            )
            credentials = [tokens.create(conn, job="writer", whole_lake=True) for _ in range(args.clients)]
        ca = trustme.CA()
        pem, ca_pem = str(Path(home) / "server.pem"), str(Path(home) / "ca.pem")
        ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(pem)
        ca.cert_pem.write_to_path(ca_pem)
        plain, plain_uri = start(settings)
        tls, tls_uri = start(settings, extra=("--tls-cert", pem, "--tls-key", pem))
        tls_uri = tls_uri.replace("http://", "https://")
        try:
            bearers = [token(plain_uri, c) for c in credentials]
            memory = memory_under_flood(plain_uri, plain.pid, bearers, args.body_mb)
            anonymous = memory_under_flood(plain_uri, plain.pid, [None] * args.clients, args.body_mb)
            tls_cost = tls_ratio(plain_uri, tls_uri, ca_pem, credentials[0], args.loads)
        finally:
            for proc in (plain, tls):
                proc.terminate()
                proc.wait(30)
        return {"memory": memory, "anonymous": anonymous, "tls": tls_cost}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=DEFAULT_SERVER, help="a server where we may CREATE DATABASE")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--body-mb", type=int, default=100)
    parser.add_argument("--loads", type=int, default=400)
    args = parser.parse_args()
    runs = [one_run(args) for _ in range(args.runs)]
    for flood, who in (("memory", "each with a job token"), ("anonymous", "without a token")):
        print(f"memory under {args.clients} clients streaming {args.body_mb} MB each, {who}; worst first:")
        for r in sorted(runs, key=lambda r: -(r[flood]["peak_mb"] - r[flood]["rest_mb"])):
            m = r[flood]
            print(
                f"  rest {m['rest_mb']:.0f} MB, peak {m['peak_mb']:.0f} MB (+{m['peak_mb'] - m['rest_mb']:.0f}), "
                f"after {m['after_mb']:.0f} MB; {m['seconds']:.1f} s; answers {m['statuses']}"
            )
    print(f"load p50 over https ÷ plain http ({args.loads} loads each), worst first (goal <= 1.1):")
    for r in sorted(runs, key=lambda r: -r["tls"]["ratio"]):
        t = r["tls"]
        print(f"  {t['tls_ms']:.2f} ms ÷ {t['plain_ms']:.2f} ms = {t['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
