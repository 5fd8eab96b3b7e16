"""The control plane and catalog at scale: what many jobs and many tables cost Postgres.

    python benchmarks/scale.py [--points 200x2000,2000x2000] [--minutes 5] [--active 2]
                               [--exec 2] [--workers 1] [--plot docs/scale.png]
                               [--poll 1h] [--heartbeat 20s]  (job exec's, serve's)
                               [--every MINUTES]  (each segment of a long window, as it ends)
                               [--steady]  (the jobs begin as in a steady state: see below)
                               [--server-log FILE]  (the server's JSON access log, for a stall)

Per point (J jobs x N managed tables): a DAG five deep of J jobs (a tenth of them roots, each
reading an external input of its own, announced), each writing one table of namespace
``scale``; N - J more managed tables of jobs that are not running (a lake's daily jobs). The
jobs are `icebarrier job exec --follow -- true`: J - E of them simulated in this process
(threads running job exec's own :class:`JobExec` against the same endpoints, the command a
no-op), E real `job exec` processes at depth five. One `icebarrier serve` (``--workers``)
serves them. A ticker issues a barrier every second, as `icebarrier schedule` does, then
announces data in the inputs of ``--active`` roots on average (2: 1 % of the roots at 2,000
jobs, the same number at every point), picked at random: those jobs have work at the next
barrier (their command runs; it writes nothing, so what reads them is
skipped with them), and the control plane skips every other job as each barrier is issued.

After a warm-up (every job bootstrapped), for ``--minutes`` it samples, and prints. (A steady
state has, per waiting job, a renewal of its long poll every ~52 minutes (``--poll``, 45-60), each
with a new access token, and a plan on time of the safety net every 15 minutes (at its job's
own point of the quarter hour: steady from the start). The long polls begin together at
bootstrap, so a window of less than 45 minutes holds no renewal, unless ``--steady``: each
simulated job's first long poll then ends at a random point within one, as if the job had been
waiting already, and takes a new token, so that a window of any length holds renewals and their
tokens at a steady state's rate. A short ``--poll`` puts many renewals in the window, to measure
what one costs.)
- Postgres transactions per second (``pg_stat_database.xact_commit`` of the benchmark's
  database: everything — server, jobs, ticker, sampling), per barrier, per job per barrier
  (goal at 2,000 jobs: <= 300 tx/s);
- the server's CPU seconds per barrier (its processes' user + system time; goal at 2,000 jobs
  <= 0.05 s);
- the notices raised per barrier (the jobs' channel, counted by a listener of its own), and the
  server's long-poll events per barrier (``icebarrier_long_poll_events_total``: plans, plans again
  on a notice or on time, renewals with no plan, heartbeat lines);
- read-committed freshness of the whole namespace (every active chain included): now - the issue
  time of the newest cut over namespace ``scale`` (p50, p95; goal p95 <= 3 s), and whether the lag
  grows (mean of the last third vs the first third);
(while the namespace's cut is more than 5 s old, every 4 s the tables behind and whether their
jobs have a session open go to stderr: a stall, as it happens);
and, for the last point against the first, each of those as a ratio (goal <= 2: cost follows the
jobs with work, not all jobs);
then, with barriers every hour, Postgres transactions per idle job per second over a minute
(goal <= 0.1) and the server's CPU a second meanwhile (what waiting costs: heartbeats, renewals).

``--plot PATH`` writes the curves (transactions per second and freshness p95 against jobs and
against tables) as a PNG (needs matplotlib: ``pip install 'icebarrier[bench]'``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from catalog import session, start  # noqa: E402 - benchmarks/catalog.py: a server process on a free port
from proc import tree_cpu_s  # noqa: E402
from scratch import DEFAULT_SERVER, scratch_database  # noqa: E402

from icebarrier.apps.job_exec import WAIT_SPREAD, JobExec, SessionClient  # noqa: E402
from icebarrier.control_plane import barriers, db, inputs, jobs, tokens  # noqa: E402
from icebarrier.control_plane.errors import InvalidValueError  # noqa: E402
from icebarrier.control_plane.model import JobDefinition, TableName, parse_duration_s  # noqa: E402
from icebarrier.control_plane.notices import Listener  # noqa: E402
from icebarrier.iceberg_ext import catalog as ib_catalog  # noqa: E402
from icebarrier.iceberg_ext.config import Settings  # noqa: E402

DEPTH = 5
NAMESPACE = "lake.scale"
STALL_S = 5.0  # the namespace's cut this far behind: the tables behind are printed (stderr)


@dataclass
class Point:
    jobs: int
    tables: int
    tx_per_s: float = 0.0
    tx_per_barrier: float = 0.0
    tx_per_job_barrier: float = 0.0
    cpu_s_per_barrier: float = 0.0
    barriers_per_s: float = 0.0
    issuers: dict[str, int] = field(default_factory=dict)  # the window's barriers by who issued them
    notices_per_barrier: float = 0.0
    long_polls: dict[str, float] = field(default_factory=dict)  # the server's long-poll events per barrier
    freshness: list[float] = field(default_factory=list)
    idle_tx_per_job_s: float = 0.0
    idle_cpu_s_per_s: float = 0.0  # the server's, while every job waits (heartbeats, renewals)

    def p(self, q: float) -> float:
        ranked = sorted(self.freshness)
        return ranked[min(len(ranked) - 1, int(len(ranked) * q))] if ranked else float("nan")

    def lag_grows(self) -> tuple[float, float, bool]:
        third = max(1, len(self.freshness) // 3)
        first, last = statistics.fmean(self.freshness[:third]), statistics.fmean(self.freshness[-third:])
        return first, last, last > first * 1.5 + 0.5


class SimulatedJob(JobExec):
    """`job exec` with a command that does nothing, run in this process (no fork per barrier).

    ``renew_at`` (``--steady``, a monotonic time): the job's long polls end there until it has
    passed, as if the job had been waiting for part of one already when the run began. Its next
    takes a new access token, as each renewal does in a steady state (the token it holds is as
    old as the long poll it ends)."""

    renew_at: float | None = None

    def _run_command(self, session: dict) -> int:
        return 0

    def _open(self, wait_s: float | None, on_line) -> dict | None:
        if self.renew_at is not None and wait_s is not None and time.monotonic() >= self.renew_at:
            self.renew_at = None
            self.client = SessionClient(self.uri, self.credential)  # no token yet: it takes a new one
        return super()._open(wait_s, on_line)

    def _poll_s(self, wait_s: float) -> float:
        if self.renew_at is None:
            return super()._poll_s(wait_s)
        return max(1.0, self.renew_at - time.monotonic())


def topology(n_jobs: int, seed: int) -> list[JobDefinition]:
    """J jobs five deep: a tenth roots, the rest spread over depths 2-5, each reading one or two
    tables of the depth above."""
    rng = random.Random(seed)
    roots = max(1, n_jobs // 10)
    per_depth = [roots] + [
        (n_jobs - roots) // (DEPTH - 1) + (1 if d < (n_jobs - roots) % (DEPTH - 1) else 0) for d in range(DEPTH - 1)
    ]
    found, above = [], []
    for depth, count in enumerate(per_depth, start=1):
        level = []
        for i in range(count):
            sink = TableName.parse(f"{NAMESPACE}.d{depth}_{i}")
            sources = frozenset(rng.sample(above, min(len(above), rng.choice((1, 2))))) if above else frozenset()
            found.append(
                JobDefinition(
                    name=f"d{depth}_{i}",
                    sources=sources,
                    sinks=frozenset([sink]),
                    external_inputs=frozenset() if sources else frozenset([f"ext:scale.{i}"]),
                )
            )
            level.append(sink)
        above = level
    return found


def build(conn, definitions: list[JobDefinition], n_tables: int) -> None:
    """The jobs (their inputs announced), and the rest of the lake: idle jobs of 100 tables each,
    completed once."""
    for definition in definitions:
        jobs.register(conn, definition)
    inputs.announce(conn, sorted(i for d in definitions for i in d.external_inputs))
    rest = n_tables - len(definitions)
    b = barriers.issue(conn).barrier
    for k in range(0, rest, 100):
        sinks = frozenset(TableName.parse(f"lake.daily{k // 100}.t{i}") for i in range(k, min(rest, k + 100)))
        jobs.register(conn, JobDefinition(name=f"daily{k // 100}", sinks=sinks, external_inputs=frozenset(["ext:d"])))
        jobs.complete(conn, f"daily{k // 100}", b)
    conn.execute("ANALYZE")


def committed(conn) -> int:
    return conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()").fetchone()[
        "xact_commit"
    ]


def freshness_s(conn) -> float | None:
    row = conn.execute(
        "SELECT extract(epoch FROM clock_timestamp() - b.issued_at)::float8 AS age "
        "FROM barrier b WHERE b.barrier = latest_cut(%s)",
        (NAMESPACE,),
    ).fetchone()
    return row["age"] if row else None


def run_point(args, n_jobs: int, n_tables: int) -> Point:
    point = Point(jobs=n_jobs, tables=n_tables)
    definitions = topology(n_jobs, args.seed)
    with scratch_database(args.dsn) as dsn, tempfile.TemporaryDirectory() as wh, db.connect(dsn) as conn:
        settings = Settings(dsn=dsn, warehouse=wh).validated()
        ib_catalog.upgrade(settings)  # the SQL catalog as `icebarrier db upgrade` leaves it (its pointer notices)
        build(conn, definitions, n_tables)
        barriers.set_anchor_interval_s(conn, 3600)
        credentials = {d.name: ":".join(tokens.create(conn, job=d.name)) for d in definitions}  # a token a job
        barriers.set_interval_s(conn, 1)
        stop = threading.Event()
        root_inputs = sorted(i for d in definitions for i in d.external_inputs)
        heard: list[int] = [0]
        side = [
            threading.Thread(
                target=ticker, args=(dsn, root_inputs, args.active / len(root_inputs), args.seed, stop), daemon=True
            ),
            threading.Thread(target=listen, args=(dsn, heard, stop), daemon=True),
        ]
        server_log = open(args.server_log, "w") if args.server_log else None  # noqa: SIM115 - the server's life
        extra = ("--heartbeat", args.heartbeat, *(("--log-format", "json") if server_log else ()))
        server, uri = start(settings, workers=args.workers, extra=extra, log=server_log)
        real = [d.name for d in definitions if d.name.startswith(f"d{DEPTH}_")][: args.exec]
        logs: dict[str, deque] = {d.name: deque(maxlen=8) for d in definitions}  # each job's last lines
        runners = [
            SimulatedJob(
                d.name,
                ["true"],
                uri=uri,
                credential=credentials[d.name],
                log=lambda line, kept=logs[d.name]: kept.append(f"{time.strftime('%H:%M:%S')} {line}"),
            )
            for d in definitions
            if d.name not in real
        ]
        if args.steady:  # each job's first renewal at a random point of its long poll, the last one's end
            rng, began = random.Random(args.seed), time.monotonic()
            for r in runners:
                r.renew_at = began + rng.random() * args.poll_s * (1 - WAIT_SPREAD * rng.random())
        threads = [
            threading.Thread(target=r.run, kwargs={"follow": True, "poll_s": args.poll_s}, daemon=True) for r in runners
        ]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "icebarrier.cli.main",
                    "job",
                    "exec",
                    name,
                    "--follow",
                    "--poll",
                    args.poll,
                    "--catalog-uri",
                    uri,
                    "--credential",
                    credentials[name],
                    "--",
                    "true",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for name in real
        ]
        try:
            for t in [*threads, *side]:
                t.start()
            deadline = time.monotonic() + 300
            while freshness_s(conn) is None:  # every job has bootstrapped
                if time.monotonic() > deadline:
                    raise SystemExit(f"{n_jobs} jobs did not all bootstrap within 5 minutes")
                time.sleep(0.5)
            time.sleep(20)
            scraper = session(uri, *credentials[definitions[0].name].split(":", 1))
            polls0 = long_poll_events(scraper, uri)
            b0, tx0, cpu0, n0, t0 = _barriers(conn), committed(conn), tree_cpu_s(server.pid), heard[0], time.monotonic()
            end = t0 + args.minutes * 60
            segment = (t0, b0, cpu0, polls0)
            while time.monotonic() < end:
                if args.every and time.monotonic() >= segment[0] + args.every * 60:
                    segment = print_segment(segment, t0, conn, server.pid, scraper, uri)
                age = freshness_s(conn)
                point.freshness.append(age if age is not None else float("nan"))
                if age is not None and age > STALL_S and len(point.freshness) % 8 == 0:
                    print(f"stalled {age:.1f} s: {behind(conn, logs)}", file=sys.stderr, flush=True)
                time.sleep(0.5)
            # busy backends flush their statistics at least every second: the window's count is good
            b1, tx1, cpu1, elapsed = _barriers(conn), committed(conn), tree_cpu_s(server.pid), time.monotonic() - t0
            point.issuers = _issuers(conn, b1 - b0)
            issued = max(1, b1 - b0)
            point.tx_per_s = (tx1 - tx0) / elapsed
            point.barriers_per_s = issued / elapsed
            point.tx_per_barrier = (tx1 - tx0) / issued
            point.tx_per_job_barrier = point.tx_per_barrier / n_jobs
            point.cpu_s_per_barrier = (cpu1 - cpu0) / issued
            point.notices_per_barrier = (heard[0] - n0) / issued
            polls1 = long_poll_events(scraper, uri)
            point.long_polls = {e: round((n - polls0.get(e, 0)) / issued, 2) for e, n in polls1.items()}
            stop.set()
            barriers.set_interval_s(conn, 3600)  # idle: no barrier is due for an hour
            time.sleep(15)  # idle backends flush their statistics within 10 s
            tx0, cpu0, t0 = committed(conn), tree_cpu_s(server.pid), time.monotonic()
            time.sleep(args.idle_s + 11)
            point.idle_tx_per_job_s = (committed(conn) - tx0 - 1) / (time.monotonic() - t0) / n_jobs
            point.idle_cpu_s_per_s = (tree_cpu_s(server.pid) - cpu0) / (time.monotonic() - t0)
        finally:
            stop.set()
            for r in runners:
                r.stop.set()
            for p in procs:
                p.terminate()
            server.terminate()
            server.wait(60)
            if server_log:
                server_log.close()
            for p in procs:
                p.wait(60)
            for t in threads:
                t.join(timeout=30)
    return point


def behind(conn, logs: dict[str, deque]) -> str:
    """The tables of the namespace more than STALL_S behind the newest barrier, their jobs' open
    sessions (what stalled a run: the monitor that found a root with data that opened none), and
    the last lines the first of those jobs logged."""
    rows = conn.execute(
        "SELECT m.name, s.job_name IS NOT NULL AS session FROM managed_tables m "
        "JOIN job_sink_tables k ON k.table_id = m.table_id JOIN jobs j ON j.job_id = k.job_id "
        "LEFT JOIN job_session s ON s.job_name = j.name "
        "WHERE starts_with(m.name, %s) AND m.watermark < (SELECT max(barrier) FROM barrier) - %s "
        "ORDER BY m.watermark, m.name",
        (NAMESPACE + ".", int(STALL_S * 1_000_000)),
    ).fetchall()
    names = [r["name"].rsplit(".", 1)[1] for r in rows]  # a table's name is its job's
    shown = ", ".join(f"{n}{' (session)' if r['session'] else ''}" for n, r in zip(names[:12], rows))
    said = f"\n  {names[0]} said: " + " | ".join(logs.get(names[0], ())) if names else ""
    return f"{len(rows)} tables behind: {shown}{', …' if len(rows) > 12 else ''}{said}"


def ticker(dsn: str, root_inputs: list[str], active: float, seed: int, stop: threading.Event) -> None:
    """What `icebarrier schedule` does for barriers (one when the clock's is due), then data
    landing: each root's input announced with probability ``active`` after each barrier."""
    rng = random.Random(seed)
    with db.connect(dsn) as conn:
        while not stop.is_set():
            due = barriers.next_due_in_s(conn)
            if due is not None and due > 0:
                stop.wait(due)
                continue
            barriers.issue_when_due(conn)
            if landed := [i for i in root_inputs if rng.random() < active]:
                inputs.announce(conn, landed)


def listen(dsn: str, heard: list[int], stop: threading.Event) -> None:
    """Count the notices the jobs' channel carries."""
    with Listener(dsn, None) as listener:
        while not stop.is_set():
            heard[0] += len(listener.wait(0.5))


def _barriers(conn) -> int:
    return conn.execute("SELECT count(*) AS n FROM barrier").fetchone()["n"]


def _issuers(conn, count: int) -> dict[str, int]:
    """Who issued the newest ``count`` barriers: the schedule (the ticker) or jobs (the clock rule)."""
    rows = conn.execute(
        "SELECT CASE WHEN issued_by = 'schedule' THEN 'schedule' ELSE 'jobs' END AS who, count(*) AS n "
        "FROM (SELECT issued_by FROM barrier ORDER BY barrier DESC LIMIT %s) b GROUP BY 1",
        (count,),
    ).fetchall()
    return {r["who"]: r["n"] for r in rows}


def long_poll_events(scraper, uri: str) -> dict[str, float]:
    """The server's ``icebarrier_long_poll_events_total`` by event (``/metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    answer = scraper.get(f"{uri}/metrics")
    answer.raise_for_status()
    return {
        sample.labels["event"]: sample.value
        for family in text_string_to_metric_families(answer.text)
        if family.name == "icebarrier_long_poll_events"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def print_segment(segment: tuple, t0: float, conn, pid: int, scraper, uri: str) -> tuple:
    """One ``--every`` segment of the window: its server CPU a barrier and long-poll events a
    barrier (a long window shows when the renewals and the safety net's plans come)."""
    now, b, cpu, polls = time.monotonic(), _barriers(conn), tree_cpu_s(pid), long_poll_events(scraper, uri)
    issued = max(1, b - segment[1])
    events = {e: round((n - segment[3].get(e, 0)) / issued, 2) for e, n in polls.items()}
    print(
        f"  minute {(segment[0] - t0) / 60:5.1f}-{(now - t0) / 60:5.1f}: server CPU "
        f"{(cpu - segment[2]) / issued:5.3f} s/barrier, long-poll events/barrier {events}",
        flush=True,
    )
    return now, b, cpu, polls


def report(point: Point) -> None:
    first, last, grows = point.lag_grows()
    print(
        f"{point.jobs:4d} jobs x {point.tables:6d} tables: {point.tx_per_s:7.1f} tx/s "
        f"({point.barriers_per_s:4.2f} barriers/s, {point.issuers}), {point.tx_per_barrier:6.1f} tx/barrier, "
        f"{point.tx_per_job_barrier:4.2f} tx/job/barrier (goal <= 2), server CPU {point.cpu_s_per_barrier:5.3f} s/barrier, "
        f"{point.notices_per_barrier:5.1f} notices/barrier, long-poll events/barrier {point.long_polls}, "
        f"freshness p50 {point.p(0.5):4.2f} s p95 {point.p(0.95):4.2f} s, lag {first:4.2f} -> {last:4.2f} s "
        f"({'GROWS' if grows else 'steady'}), idle {point.idle_tx_per_job_s:5.3f} tx/job/s (goal <= 0.1) "
        f"and {point.idle_cpu_s_per_s:5.3f} s of server CPU a second",
        flush=True,
    )


def plot(points: list[Point], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'icebarrier[bench]'") from None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    by_tables = sorted({p.tables for p in points})
    for tables in by_tables:
        row = sorted((p for p in points if p.tables == tables), key=lambda p: p.jobs)
        axes[0].plot([p.jobs for p in row], [p.tx_per_s for p in row], "o-", label=f"{tables:,} tables")
        axes[1].plot([p.jobs for p in row], [p.tx_per_job_barrier for p in row], "o-", label=f"{tables:,} tables")
        axes[2].plot([p.jobs for p in row], [p.p(0.95) for p in row], "o-", label=f"{tables:,} tables")
    axes[0].axhline(600, color="grey", linestyle=":", label="goal at 200 jobs")
    axes[1].axhline(2, color="grey", linestyle=":", label="goal")
    axes[2].axhline(3, color="grey", linestyle=":", label="goal")
    for ax, title in zip(
        axes,
        ("Postgres transactions / s", "transactions / job / barrier", "read-committed freshness p95 at depth 5 (s)"),
    ):
        ax.set_title(title)
        ax.set_xlabel("jobs (1-s barriers)")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=DEFAULT_SERVER)
    parser.add_argument("--points", default="200x2000,2000x2000", help="JOBSxTABLES,… to measure")
    parser.add_argument("--active", type=float, default=2.0, help="roots with data at each barrier, on average")
    parser.add_argument("--minutes", type=float, default=5.0, help="1-s barriers this long per point")
    parser.add_argument("--every", type=float, help="also print each segment of this many minutes of the window")
    parser.add_argument("--idle-s", type=float, default=60.0, help="the idle measurement's length")
    parser.add_argument("--poll", default="1h", help="each job's long poll (`job exec --poll`)")
    parser.add_argument(
        "--steady",
        action="store_true",
        help="begin in a steady state: each job's first long poll ends at random within one (renewals and "
        "their new tokens at a steady state's rate from the start)",
    )
    parser.add_argument("--heartbeat", default="20s", help="`icebarrier serve --heartbeat`: a waiting job's line")
    parser.add_argument("--exec", type=int, default=2, help="jobs at depth 5 run as real `job exec` processes")
    parser.add_argument("--workers", type=int, default=1, help="`icebarrier serve --workers`")
    parser.add_argument("--server-log", help="write the server's access log (JSON lines) to this file")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--plot", help="write the curves to this PNG")
    args = parser.parse_args()
    try:
        args.poll_s = parse_duration_s(args.poll)  # before any point starts a server
    except InvalidValueError as exc:
        parser.error(f"--poll: {exc}")
    points = []
    for spec in args.points.split(","):
        n_jobs, n_tables = (int(x) for x in spec.split("x"))
        points.append(run_point(args, n_jobs, max(n_tables, n_jobs)))
        report(points[-1])
    if len(points) > 1:
        first, last = points[0], points[-1]
        print(
            f"{last.jobs} jobs / {first.jobs} jobs (goal <= 2 each): tx/s {last.tx_per_s / first.tx_per_s:.2f}, "
            f"server CPU/barrier {last.cpu_s_per_barrier / first.cpu_s_per_barrier:.2f}, "
            f"notices/barrier {last.notices_per_barrier / max(first.notices_per_barrier, 1e-9):.2f}, "
            f"freshness p95 {last.p(0.95) / first.p(0.95):.2f}",
            flush=True,
        )
    if args.plot:
        plot(points, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
