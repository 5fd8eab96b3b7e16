"""Prometheus metrics of the lake and the catalog, at ``GET /metrics`` (``icebarrier_`` prefix,
base units).

At each scrape, from the control plane (a few queries): per managed table its freshness (now −
issue time of its watermark), its lag (age of the oldest barrier it has not completed; 0 when
caught up), the barriers it is behind, its target lag and whether it is met; barriers issued (a
counter: its rate is the barrier rate) and the read-committed cut's age; per job that says how
it computes (an SqlJob), its computations, incremental and full; per table what the maintenance
service saw at its last look (snapshots, data files, small ones, manifests, metadata-file size)
and its actions by result. From this server process: catalog table loads by warehouse kind, as
a latency histogram; loads answered from memory or the database, and whether the memory is live
(:mod:`.load_cache`).
"""

from __future__ import annotations

from fastapi import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from icebarrier.apps.catalog.deps import Caller
from icebarrier.control_plane import upkeep

SCRAPE = """
SELECT v.table_name, extract(epoch FROM v.freshness) AS freshness_s, v.barriers_behind,
       coalesce(extract(epoch FROM now() - (SELECT min(b.issued_at) FROM barrier b
                                            WHERE b.barrier > v.watermark_barrier)), 0) AS lag_s,
       extract(epoch FROM v.effective_target_lag) AS target_lag_s, v.target_met
FROM table_versions v WHERE v.watermark_barrier IS NOT NULL OR v.effective_target_lag IS NOT NULL
ORDER BY v.table_name
"""
COMPUTATIONS = "SELECT job_name, incremental_total, full_total FROM job_computations ORDER BY job_name"
MAINTENANCE = """
SELECT table_name, snapshots, data_files, small_files, manifests, metadata_bytes, actions
FROM table_maintenance WHERE checked_at IS NOT NULL OR actions <> '{}' ORDER BY table_name
"""
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


class LakeCollector:
    """Reads the control plane at scrape time."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def collect(self):
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
        with self.pool.connection() as conn:
            for r in conn.execute(SCRAPE).fetchall():
                name = [r["table_name"]]
                if r["freshness_s"] is not None:
                    freshness.add_metric(name, float(r["freshness_s"]))
                    lag.add_metric(name, float(r["lag_s"]))
                    behind.add_metric(name, float(r["barriers_behind"]))
                if r["target_lag_s"] is not None:
                    target.add_metric(name, float(r["target_lag_s"]))
                    met.add_metric(name, 1.0 if r["target_met"] else 0.0)
            totals = conn.execute(TOTALS).fetchone()
            computations = conn.execute(COMPUTATIONS).fetchall()
            maintained = conn.execute(MAINTENANCE).fetchall()
        yield freshness
        yield lag
        yield behind
        yield target
        yield met
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
        computed = CounterMetricFamily(
            "icebarrier_job_computations",
            "Barriers a job computed (an SqlJob says how): from the changes since its previous "
            "barrier (incremental) or in full",
            labels=["job", "kind"],
        )
        for r in computations:
            computed.add_metric([r["job_name"], "incremental"], r["incremental_total"])
            computed.add_metric([r["job_name"], "full"], r["full_total"])
        yield computed
        yield from _maintenance(maintained)


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
    for r in rows:
        if r["snapshots"] is not None:
            for column, family in seen.items():
                family.add_metric([r["table_name"]], float(r[column]))
        for action, result, n in upkeep.counts(r["actions"]):
            actions.add_metric([r["table_name"], action, result], n)
    yield from seen.values()
    yield actions


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
        yield GaugeMetricFamily(
            "icebarrier_catalog_load_cache_live",
            "1 while this process listens for the notices that keep its memory of loads current, else 0",
            value=1.0 if self.cache.live else 0.0,
        )


class Metrics:
    """A server's registry: the lake's metrics and this process's loads (latency, memory)."""

    def __init__(self, lake) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(LakeCollector(lake.pool))
        self.registry.register(LoadCacheCollector(lake.load_cache))
        self.load_seconds = Histogram(
            "icebarrier_catalog_load_seconds",
            "Latency of a table load through the catalog, by warehouse kind",
            ["warehouse"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )


def install(app, lake) -> None:
    """Serve ``GET /metrics`` (a reader's token, like any read); the load route times each load
    into ``app.state.metrics.load_seconds``."""
    app.state.metrics = metrics = Metrics(lake)

    @app.get("/metrics")
    def scrape(who: Caller):
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
