"""``icebarrier demo``: a zero-config tour on a real Spark + Iceberg + Postgres pipeline."""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import replace

import click
import psycopg

from icebarrier.apps.scratch import scratch
from icebarrier.cli.render import Seconds, above, duration, emit, table, terminal_progress
from icebarrier.control_plane import db, schema


@click.command("demo")
@click.option("--scenario", type=click.Choice(["shopping", "transfers", "all"]), default="all", show_default=True)
@click.option("--rounds", type=click.IntRange(2, 50), default=6, show_default=True, help="Barriers to run.")
@click.option("--keep", is_flag=True, help="Keep the demo database and warehouse (and leave the server running).")
@click.option(
    "--warehouse",
    "under",
    metavar="URI",
    help="Put the demo's warehouse under this one (e.g. s3://bucket/prefix, with the [storage] settings of "
    "icebarrier.toml or the AWS_* variables); default: a folder under ~/.icebarrier/.",
)
@click.pass_obj
def demo(obj, scenario: str, rounds: int, keep: bool, under: str | None) -> None:
    """Run a pipeline whose jobs commit at different speeds while a reader checks an invariant
    at every consistency level; print the topology, anomalies per level, delays and a
    lease-protected expiry.

    Without --dsn / ICEBARRIER_DSN it starts an embedded Postgres (data under
    ~/.icebarrier/, or $ICEBARRIER_HOME) and stops it afterwards; it writes nothing
    outside that state directory."""
    from icebarrier.iceberg_ext.config import Settings
    from icebarrier.iceberg_ext.storage import check_warehouse

    say = lambda line: click.echo(line, err=obj.output == "json")  # noqa: E731
    started = time.perf_counter()
    storage = Settings.load_storage(obj.config)
    if under:  # wrong settings: one line before anything starts
        check_warehouse(under, storage.fileio())
    with scratch(obj, "demo", say, keep=keep, under=under, storage=storage) as (dsn, warehouse):
        settings = Settings(dsn=dsn, warehouse=str(warehouse), storage=storage).validated()
        results = _run(settings, scenario, rounds, say)
        payload = {
            "database": psycopg.conninfo.conninfo_to_dict(dsn)["dbname"],
            "warehouse": str(warehouse),
            "results": [r.to_json() for r in results],
            "seconds": round(time.perf_counter() - started, 1),
        }
        emit(
            obj,
            payload,
            lambda: (
                "\n\n".join(_render(r) for r in results)
                + f"\n\ndemo finished in {duration(time.perf_counter() - started)}"
            ),
        )
    if any(r.levels[lvl].anomalies for r in results for lvl in ("read-committed", "repeatable-read")):
        raise SystemExit(1)


def _live(say):
    """A live progress display on a terminal (one bar per scenario: barriers done, elapsed,
    what runs now), the lines above it; elsewhere the lines alone."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    bars = terminal_progress(
        TextColumn("{task.fields[scenario]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    if bars is None:
        return contextlib.nullcontext((say, None))
    tasks: dict[str, int] = {}

    def step(scenario: str, done: int, of: int, what: str) -> None:
        if scenario not in tasks:
            tasks[scenario] = bars.add_task(what, total=of, scenario=scenario)
        bars.update(tasks[scenario], completed=done, description=what)

    @contextlib.contextmanager
    def live():
        with bars:
            yield above(bars), step

    return live()


def _run(settings, scenario: str, rounds: int, say):
    from icebarrier.apps.demo import run_demo
    from icebarrier.iceberg_ext.catalog import load_catalog, upgrade
    from icebarrier.iceberg_ext.spark import spark_session

    upgrade(settings)
    say("starting Spark (local) …")
    spark = spark_session(settings, app_name="icebarrier-demo")
    spark.sparkContext.setLogLevel("ERROR")
    catalog = load_catalog(settings)
    names = ["shopping", "transfers"] if scenario == "all" else [scenario]
    results = []
    try:
        with _live(say) as (line, step):
            for name in names:  # each scenario has a control plane of its own (its own schema)
                scoped = replace(settings, schema=f"demo_{name}")
                schema.upgrade(scoped.dsn, scoped.schema)
                with db.connect(scoped.dsn, scoped.schema) as conn:
                    results.append(
                        run_demo(
                            conn,
                            scoped,
                            spark,
                            catalog,
                            scenario=name,
                            rounds=rounds,
                            progress=line,
                            step=step and functools.partial(step, name),
                        )
                    )
        return results
    finally:
        spark.stop()


def _render(r) -> str:
    lines = [
        f"=== scenario {r.scenario}: {r.barriers} barriers in {duration(r.seconds)}",
        "",
        "topology:",
        r.topology_text,
        "",
        "reads per consistency level:",
    ]
    lines.append(
        table(
            ["level", "queries", "anomalies", "first anomaly"],
            [(lvl, s.queries, s.anomalies, s.example or "-") for lvl, s in r.levels.items()],
        )
    )
    lines.append(f"repeatable-read session: {r.repeatable_read_changes} change(s) seen across its statements")
    lines += ["", "delays:"]
    lines.append(
        table(
            ["table", "barriers", "p50", "max", "behind"],
            [(d.name, d.barriers, Seconds(d.p50_s), Seconds(d.max_s), d.barriers_behind) for d in r.table_delays],
        )
    )
    lines.append(
        table(
            ["job", "barriers", "p50", "max", "bottleneck"],
            [
                (d.name, d.barriers, Seconds(d.p50_s), Seconds(d.max_s), "<-" if d.bottleneck else "")
                for d in r.job_delays
            ],
        )
    )
    e = r.expiry
    lines += [
        "",
        f"lease-aware expiry of {e['table']}: expired {e['expired']} snapshot(s), deleted "
        f"{e['files_deleted']} file(s), kept {e['kept']} (snapshots {e['kept_by_lease']} held by the "
        f"repeatable-read session's lease)",
    ]
    return "\n".join(lines)


COMMANDS = [demo]
