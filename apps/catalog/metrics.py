"""Prometheus metrics of the lake and the catalog, at ``GET /metrics`` (``icebarrier_`` prefix,
base units).

The series stay bounded however large the lake: by default the lake is summarized — managed
tables counted by kind and by their target's state (met, at risk, missed, none: as
:func:`~icebarrier.control_plane.targets.target_state` says), the stalest freshness and the most
barriers behind per kind, computations and maintenance actions summed — and per-table or per-job
series come only on request, for what the scrape names: ``?table=NAME`` and ``?namespace=NS``
(each repeatable; a namespace takes the tables under it), ``?tables=all``; ``?job=NAME``,
``?jobs=all``. Per table then: its freshness (now − issue time of its watermark), its lag (age of
the oldest barrier it has not completed; 0 when caught up), the barriers it is behind, its target
lag and whether it is met, and what the maintenance service saw at its last look (snapshots,
data files, small ones, manifests, metadata-file size) and its actions by result; per job that
says how it computes (an SqlJob), its computations, incremental and full. Always: barriers
issued (a counter: its rate is the barrier rate) and the read-committed cut's age. From this
server process: catalog table loads by warehouse kind, as a latency histogram; loads answered
from memory or the database, and whether the memory is live (:mod:`.load_cache`); the long polls
of `job exec --follow` it holds waiting for a notice, and what they cost by event (plans, plans
again on a notice or on time, renewals taken up with no plan, heartbeat lines); how long Python's
garbage collector held it, by generation (every answer waits while it runs).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from fastapi import Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from icebarrier.apps.catalog.deps import Caller
from icebarrier.apps.catalog.notices import LONG_POLL_EVENTS
from icebarrier.control_plane import upkeep
from icebarrier.control_plane.targets import target_state_sql

_IN_SCOPE = """(%(all)s OR {name} = ANY(%(tables)s::text[])
     OR EXISTS (SELECT 1 FROM unnest(%(namespaces)s::text[]) n WHERE starts_with({name}, n || '.')))"""
SCRAPE = f"""
SELECT v.table_name, extract(epoch FROM v.freshness) AS freshness_s, v.barriers_behind,
       coalesce(extract(epoch FROM now() - (SELECT min(b.issued_at) FROM barrier b
                                            WHERE b.barrier > v.watermark_barrier)), 0) AS lag_s,
       extract(epoch FROM v.effective_target_lag) AS target_lag_s, v.target_met
FROM table_versions v
WHERE (v.watermark_barrier IS NOT NULL OR v.effective_target_lag IS NOT NULL) AND {_IN_SCOPE.format(name="v.table_name")}
ORDER BY v.table_name
"""
# the lake in a few rows: tables by kind and target state, and the oldest watermark of each
SUMMARY = f"""
WITH t AS (
    SELECT CASE WHEN k.job_id IS NULL THEN 'unowned'
                WHEN EXISTS (SELECT 1 FROM job_source s WHERE s.job_id = k.job_id) THEN 'intermediate'
                ELSE 'root' END AS kind,
           {target_state_sql("now() - b.issued_at", "tt.effective_target_lag")} AS target, m.watermark
    FROM managed_table m
    LEFT JOIN job_sink k ON k.table_id = m.table_id
    LEFT JOIN barrier b ON b.barrier = m.watermark
    LEFT JOIN table_targets tt ON tt.table_id = m.table_id)
SELECT kind, target, count(*) AS tables, min(watermark) AS oldest,
       extract(epoch FROM now() - (SELECT x.issued_at FROM barrier x WHERE x.barrier = min(t.watermark))) AS stalest_s,
       (SELECT count(*) FROM barrier x WHERE x.barrier > min(t.watermark)) AS most_behind
FROM t GROUP BY kind, target
"""
COMPUTATIONS = """
SELECT job_name, incremental_total, full_total FROM job_computations
WHERE %(all)s OR job_name = ANY(%(jobs)s::text[]) ORDER BY job_name
"""
COMPUTATION_TOTALS = (
    "SELECT coalesce(sum(incremental_total), 0) AS incremental, coalesce(sum(full_total), 0) AS full "
    "FROM job_computations"
)
MAINTENANCE = f"""
SELECT table_name, snapshots, data_files, small_files, manifests, metadata_bytes, actions,
       metadata_files, data_files_under, extract(epoch FROM orphans_checked_at) AS orphans_checked_at
FROM table_maintenance WHERE (checked_at IS NOT NULL OR actions <> '{{}}') AND {_IN_SCOPE.format(name="table_name")}
ORDER BY table_name
"""
ACTIONS = "SELECT actions FROM table_maintenance WHERE actions <> '{}'"
SEEN = (  # a table_maintenance column, its metric, its help
    ("snapshots", "icebarrier_table_snapshots", "Snapshots in the table's metadata"),
    ("data_files", "icebarrier_table_data_files", "Data files in the table's current snapshot"),
    ("small_files", "icebarrier_table_small_files", "Of those, files smaller than the policy's target size"),
    ("manifests", "icebarrier_table_manifests", "Manifests in the table's current snapshot"),
    ("metadata_bytes", "icebarrier_table_metadata_bytes", "Size of the table's current metadata file"),
)
TOTALS = """
SELECT (SELECT count(*) FROM barrier) AS barriers,
       (SELECT extract(epoch FROM now() - c.issued_at) FROM consistent_barrier c) AS cut_age_s
"""


@dataclass(frozen=True, slots=True)
class Scope:
    """The tables and jobs a scrape asked per-table and per-job series for (the query string)."""

    tables: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = ()
    all_tables: bool = False
    jobs: tuple[str, ...] = ()
    all_jobs: bool = False

    @classmethod
    def of(cls, params) -> Scope:
        return cls(
            tables=tuple(params.getlist("table")),
            namespaces=tuple(params.getlist("namespace")),
            all_tables=params.get("tables") == "all",
            jobs=tuple(params.getlist("job")),
            all_jobs=params.get("jobs") == "all",
        )

    @property
    def any_table(self) -> bool:
        return self.all_tables or bool(self.tables or self.namespaces)

    def table_params(self) -> dict:
        return {"all": self.all_tables, "tables": list(self.tables), "namespaces": list(self.namespaces)}


class LakeCollector:
    """Reads the control plane at scrape time: the lake summarized, and the series per table and
    per job of what the scrape names."""

    def __init__(self, pool, scope: Scope) -> None:
        self.pool, self.scope = pool, scope

    def collect(self):
        with self.pool.connection() as conn:
            summary = conn.execute(SUMMARY).fetchall()
            totals = conn.execute(TOTALS).fetchone()
            computed = conn.execute(COMPUTATION_TOTALS).fetchone()
            actions = conn.execute(ACTIONS).fetchall()
            per_table = conn.execute(SCRAPE, self.scope.table_params()).fetchall() if self.scope.any_table else []
            maintained = conn.execute(MAINTENANCE, self.scope.table_params()).fetchall() if self.scope.any_table else []
            per_job = (
                conn.execute(COMPUTATIONS, {"all": self.scope.all_jobs, "jobs": list(self.scope.jobs)}).fetchall()
                if self.scope.all_jobs or self.scope.jobs
                else []
            )
        yield from _summary(summary)
        yield from _per_table(per_table)
        yield CounterMetricFamily(
            "icebarrier_barriers_issued", "Barriers issued (its rate is the barrier rate)", value=totals["barriers"]
        )
        cut = GaugeMetricFamily(
            "icebarrier_read_committed_cut_age_seconds",
            "Now minus the issue time of the newest barrier every managed table completed",
        )
        if totals["cut_age_s"] is not None:
            cut.add_metric([], float(totals["cut_age_s"]))
        yield cut
        all_computed = CounterMetricFamily(
            "icebarrier_computations", "Barriers the jobs computed, summed over the jobs, by kind", labels=["kind"]
        )
        all_computed.add_metric(["incremental"], computed["incremental"])
        all_computed.add_metric(["full"], computed["full"])
        yield all_computed
        jobs_computed = CounterMetricFamily(
            "icebarrier_job_computations",
            "Barriers a job computed (an SqlJob says how): from the changes since its previous "
            "barrier (incremental) or in full (the jobs the scrape names: ?job=NAME, ?jobs=all)",
            labels=["job", "kind"],
        )
        for r in per_job:
            jobs_computed.add_metric([r["job_name"], "incremental"], r["incremental_total"])
            jobs_computed.add_metric([r["job_name"], "full"], r["full_total"])
        yield jobs_computed
        all_actions = CounterMetricFamily(
            "icebarrier_maintenance_actions_all",
            "Maintenance actions on every table, by action and result",
            labels=["action", "result"],
        )
        summed: dict[tuple[str, str], int] = {}
        for r in actions:
            for action, result, n in upkeep.counts(r["actions"]):
                summed[action, result] = summed.get((action, result), 0) + n
        for (action, result), n in sorted(summed.items()):
            all_actions.add_metric([action, result], n)
        yield all_actions
        yield from _maintenance(maintained)


def _summary(rows: list[dict]):
    """The managed tables by kind and target state; per kind the stalest and the most behind."""
    counted = GaugeMetricFamily(
        "icebarrier_tables",
        "Managed tables by kind and by state against their target lag (met, at_risk, missed, none)",
        labels=["kind", "target"],
    )
    stalest = GaugeMetricFamily(
        "icebarrier_tables_stalest_seconds", "The largest freshness among the tables of a kind", labels=["kind"]
    )
    behind = GaugeMetricFamily(
        "icebarrier_tables_most_barriers_behind", "The most barriers any table of a kind is behind", labels=["kind"]
    )
    by_kind: dict[str, list[dict]] = {}
    for r in rows:
        counted.add_metric([r["kind"], r["target"]], r["tables"])
        by_kind.setdefault(r["kind"], []).append(r)
    for kind, group in sorted(by_kind.items()):
        ages = [float(r["stalest_s"]) for r in group if r["stalest_s"] is not None]
        if ages:
            stalest.add_metric([kind], max(ages))
            behind.add_metric([kind], max(r["most_behind"] for r in group if r["stalest_s"] is not None))
    yield from (counted, stalest, behind)


def _per_table(rows: list[dict]):
    """Freshness, lag, barriers behind and target of the tables the scrape names."""
    freshness = GaugeMetricFamily(
        "icebarrier_table_freshness_seconds",
        "Now minus the issue time of the table's watermark barrier",
        labels=["table"],
    )
    lag = GaugeMetricFamily(
        "icebarrier_table_lag_seconds",
        "Age of the oldest barrier the table has not completed (0: caught up)",
        labels=["table"],
    )
    behind = GaugeMetricFamily(
        "icebarrier_table_barriers_behind", "Barriers issued after the table's watermark", labels=["table"]
    )
    target = GaugeMetricFamily(
        "icebarrier_table_target_lag_seconds",
        "The table's target lag (its own, or inherited from the tables that read it)",
        labels=["table"],
    )
    met = GaugeMetricFamily(
        "icebarrier_table_target_met",
        "1 while the table's freshness is within its target lag, else 0",
        labels=["table"],
    )
    for r in rows:
        name = [r["table_name"]]
        if r["freshness_s"] is not None:
            freshness.add_metric(name, float(r["freshness_s"]))
            lag.add_metric(name, float(r["lag_s"]))
            behind.add_metric(name, float(r["barriers_behind"]))
        if r["target_lag_s"] is not None:
            target.add_metric(name, float(r["target_lag_s"]))
            met.add_metric(name, 1.0 if r["target_met"] else 0.0)
    yield from (freshness, lag, behind, target, met)


def _maintenance(rows: list[dict]):
    """What the maintenance service saw of each table (as of its last look) and did."""
    seen = {
        column: GaugeMetricFamily(metric, text + " (as the maintenance service last saw it)", labels=["table"])
        for column, metric, text in SEEN
    }
    actions = CounterMetricFamily(
        "icebarrier_maintenance_actions",
        "Maintenance actions on a table (expire, compact, rewrite-manifests, remove-orphans) by result",
        labels=["table", "action", "result"],
    )
    files = GaugeMetricFamily(
        "icebarrier_table_files",
        "Files under the table's location by folder (metadata: metadata files, manifest lists, manifests; "
        "data: the rest), as the maintenance service's last orphan removal counted them",
        labels=["table", "folder"],
    )
    orphans_checked = GaugeMetricFamily(
        "icebarrier_table_orphans_checked_timestamp_seconds",
        "When the maintenance service last listed the table's files and removed its orphans",
        labels=["table"],
    )
    took = GaugeMetricFamily(
        "icebarrier_maintenance_last_action_seconds",
        "How long the maintenance service's last action of each kind on the table took (a service "
        "falling behind shows where its time goes)",
        labels=["table", "action"],
    )
    for r in rows:
        name = r["table_name"]
        if r["snapshots"] is not None:
            for column, family in seen.items():
                family.add_metric([name], float(r[column]))
        for action, result, n in upkeep.counts(r["actions"]):
            actions.add_metric([name, action, result], n)
        for action, last in r["actions"].items():
            if (seconds := (last.get("detail") or {}).get("seconds")) is not None:
                took.add_metric([name, action], float(seconds))
        if r["orphans_checked_at"] is not None:
            files.add_metric([name, "metadata"], float(r["metadata_files"]))
            files.add_metric([name, "data"], float(r["data_files_under"]))
            orphans_checked.add_metric([name], float(r["orphans_checked_at"]))
    yield from seen.values()
    yield actions
    yield files
    yield orphans_checked
    yield took


class LoadCacheCollector:
    """This process's memory of what loads read (:mod:`.load_cache`)."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def collect(self):
        answered = CounterMetricFamily(
            "icebarrier_catalog_loads_answered",
            "Loads through latest, read-committed and barrier-<B> by where what they read came from: "
            "this process's memory or the database",
            labels=["from"],
        )
        answered.add_metric(["memory"], self.cache.hits)
        answered.add_metric(["database"], self.cache.misses)
        yield answered
        yield CounterMetricFamily(
            "icebarrier_catalog_load_cache_catch_ups",
            "Times this process's memory caught up with the database before answering again "
            "(one Sync on its listening connection)",
            value=self.cache.catch_ups,
        )
        yield CounterMetricFamily(
            "icebarrier_catalog_moment_touches",
            "Statements in which this process told the database when its read-committed sessions last "
            "used their moments (session_touch: one for all of them, every twentieth of the quiet interval)",
            value=self.cache.touches,
        )
        yield GaugeMetricFamily(
            "icebarrier_catalog_load_cache_live",
            "1 while this process listens for the notices that keep its memory of loads current, else 0",
            value=1.0 if self.cache.live else 0.0,
        )


class ManifestCacheCollector:
    """The manifests this process's scan plans keep decoded (:class:`.scan_planning.ManifestCache`)."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def collect(self):
        reads = CounterMetricFamily(
            "icebarrier_catalog_plan_manifest_reads",
            "Manifests scan plans read, by where their entries came from: kept from an earlier plan (hit) "
            "or read from storage (miss)",
            labels=["from"],
        )
        reads.add_metric(["hit"], self.cache.hits)
        reads.add_metric(["miss"], self.cache.misses)
        yield reads
        yield GaugeMetricFamily(
            "icebarrier_catalog_plan_manifest_entries",
            f"Manifest entries this process keeps decoded for scan plans (at most {self.cache.max_entries})",
            value=self.cache.entries,
        )


class GcPauses:
    """How long each of Python's garbage collections held this process, by generation: a
    ``gc.callbacks`` entry (:func:`.server.process_app` adds it) counting into plain lists, not a
    Histogram, whose lock a collection could start inside of."""

    BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

    def __init__(self) -> None:
        self.counts = [[0] * (len(self.BUCKETS_S) + 1) for _ in range(3)]  # per generation, per bucket
        self.sums_s = [0.0] * 3
        self.started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        took_s = time.perf_counter() - self.started
        generation = info["generation"]
        self.sums_s[generation] += took_s
        self.counts[generation][bisect.bisect_left(self.BUCKETS_S, took_s)] += 1

    def collect(self):
        pauses = HistogramMetricFamily(
            "icebarrier_catalog_gc_pause_seconds",
            "How long Python's garbage collector held this process (every answer waits), by generation",
            labels=["generation"],
        )
        for generation, counts in enumerate(self.counts):
            cumulative, buckets = 0, []
            for bound, count in zip((*map(str, self.BUCKETS_S), "+Inf"), counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            pauses.add_metric([str(generation)], buckets, self.sums_s[generation])
        yield pauses


class HubCollector:
    """The long polls this process holds (:mod:`.notices`)."""

    def __init__(self, hub) -> None:
        self.hub = hub

    def collect(self):
        yield GaugeMetricFamily(
            "icebarrier_long_polls_waiting",
            "Job sessions' long polls (job exec --follow) this process holds waiting for a notice",
            value=self.hub.waiting,
        )
        events = CounterMetricFamily(
            "icebarrier_long_poll_events",
            "What the long polls cost this process: planned (a request's first plan), woken and due (planned "
            "again: a notice, or its time), renewed (a job's next ask taken up with no plan), heartbeat (a line)",
            labels=["event"],
        )
        for event in LONG_POLL_EVENTS:
            events.add_metric([event], self.hub.events[event])
        yield events


class Metrics:
    """A server's metrics: the lake's (read at each scrape, for its scope) and this process's
    loads (latency, memory) and long polls."""

    def __init__(self, lake, hub) -> None:
        self.lake = lake
        self.registry = CollectorRegistry(auto_describe=False)  # this process's own
        self.registry.register(LoadCacheCollector(lake.load_cache))
        self.registry.register(HubCollector(hub))
        self.registry.register(ManifestCacheCollector(lake.manifest_cache))
        self.gc_pauses = GcPauses()  # counts once a serving process adds it to gc.callbacks
        self.registry.register(self.gc_pauses)
        self.load_seconds = Histogram(
            "icebarrier_catalog_load_seconds",
            "Latency of a table load through the catalog, by warehouse kind",
            ["warehouse"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.plans = Counter(
            "icebarrier_catalog_plans",
            "Scans planned on the server (planTableScan), by warehouse kind",
            ["warehouse"],
            registry=self.registry,
        )
        self.not_modified = Counter(
            "icebarrier_catalog_loads_not_modified",
            "Table loads answered 304 Not Modified (the client had the answer: its ETag), by warehouse kind",
            ["warehouse"],
            registry=self.registry,
        )


def install(app, lake, hub) -> None:
    """Serve ``GET /metrics`` (a reader's token, like any read); the load route times each load
    into ``app.state.metrics.load_seconds``."""
    app.state.metrics = metrics = Metrics(lake, hub)

    @app.get("/metrics")
    def scrape(who: Caller, request: Request):
        lake_registry = CollectorRegistry(auto_describe=False)
        lake_registry.register(LakeCollector(lake.pool, Scope.of(request.query_params)))
        return Response(
            generate_latest(lake_registry) + generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST
        )
