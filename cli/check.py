"""``icebarrier check``: the seeded consistency checker."""

from __future__ import annotations

import contextlib
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import click

from icebarrier.cli.render import above, emit, table, terminal_progress
from icebarrier.iceberg_ext.faults import MUTATIONS


@contextlib.contextmanager
def _broker(broker, topic: str):
    """The run's Kafka broker with its topic (two partitions, the broker's timestamps), stopped at the end."""
    broker.start()
    try:
        broker.create_topic(topic, partitions=2, config={"message.timestamp.type": "LogAppendTime"})
        yield broker
    finally:
        broker.stop()


@click.command("check")
@click.option("--seed", type=int, help="Seed to reproduce a run (default: random, printed).")
@click.option(
    "--duration",
    "duration_s",
    type=click.FloatRange(3, 86400),
    default=20,
    show_default=True,
    help="Seconds of barriers, jobs, faults, readers and expiry before the final validation.",
)
@click.option(
    "--fault-rate",
    type=click.FloatRange(0, 1),
    default=0.3,
    show_default=True,
    help="Chance that a job process is started with a random fault point armed (kills scale with it).",
)
@click.option(
    "--restarts/--no-restarts",
    default=True,
    show_default=True,
    help="Restart the run's control-plane Postgres at random moments (about one per 10 s).",
)
@click.option(
    "--failover",
    is_flag=True,
    help="Run the control plane on a Postgres primary and its synchronous standby: where the run would "
    "restart Postgres, kill the primary (-9), promote the standby and rebuild a standby from the dead node; "
    "every component follows the multi-host DSN.",
)
@click.option("--keep", is_flag=True, help="Keep the run's Postgres data and warehouse for inspection.")
@click.option(
    "--warehouse",
    "under",
    metavar="URI",
    help="Put the run's warehouse under this one (e.g. s3://bucket/prefix, with the [storage] settings of "
    "icebarrier.toml or the AWS_* variables); default: the run's temporary folder.",
)
@click.option(
    "--exec-jobs/--no-exec-jobs",
    default=True,
    show_default=True,
    help="Run orders_in and balances_job as plain PyIceberg scripts under `icebarrier job exec`, through "
    "a catalog server the run starts and kills at random; validate cuts through it too.",
)
@click.option(
    "--mutation",
    type=click.Choice(MUTATIONS),
    help="Run the catalog server and the maintenance service with this deliberate bug: the run must fail "
    "(a test of the checker).",
)
@click.option(
    "--maintain",
    is_flag=True,
    help="Run the maintenance service (`icebarrier maintain`, aggressive policies: it expires, compacts and "
    "rewrites manifests as soon as it may) in place of the expiry process, killed and restarted at random.",
)
@click.option(
    "--kafka",
    is_flag=True,
    help="Run orders_in as a Kafka root job: the run starts a broker (KRaft, from Maven Central) and produces "
    "each barrier's orders to a topic, with aborted transactions that no cut may show.",
)
@click.option(
    "--fail-fast",
    is_flag=True,
    help="End the run at its first violation (the report names it; the jobs are not waited for and the "
    "final audits do not run): for a run that should fail, such as one with --mutation.",
)
@click.pass_obj
def check(
    obj,
    seed: int | None,
    duration_s: float,
    fault_rate: float,
    restarts: bool,
    failover: bool,
    keep: bool,
    under: str | None,
    exec_jobs: bool,
    mutation: str | None,
    maintain: bool,
    kafka: bool,
    fail_fast: bool,
) -> None:
    """Run root and intermediate jobs and an expiry as real processes at random speeds, kill jobs
    at random fault points and restart the control-plane Postgres, while readers query at every
    level (through the catalog server too); two jobs run under `icebarrier job exec`, whose
    catalog server is killed and restarted; validate every barrier, read and pin against a model that is a function of the seed.
    Jobs coalesce at random and some run as batch jobs; cuts at coalesced barriers must be
    refused, anchors never.

    The run always uses a private embedded Postgres (never --dsn: it restarts its server), or with
    --failover a private primary and standby that it fails over.
    Exits 1 on any anomaly at read-committed or repeatable-read, any lost or duplicated
    (table, barrier), any pinned snapshot expired, or coverage below the stated floor."""
    from icebarrier.apps.check import CheckReport, private_env, run_check
    from icebarrier.apps.embedded import EmbeddedPostgres
    from icebarrier.iceberg_ext.catalog import upgrade
    from icebarrier.iceberg_ext.config import Settings
    from icebarrier.iceberg_ext.storage import check_warehouse, remove_tree

    seed = seed if seed is not None else random.randrange(1, 1_000_000)
    say = lambda line: click.echo(line, err=True)  # noqa: E731
    storage = Settings.load_storage(obj.config)
    warehouse = f"{under.rstrip('/')}/check-{seed}-{random.randrange(16**8):08x}" if under else None
    if warehouse:  # wrong settings: one line before anything starts
        check_warehouse(warehouse, storage.fileio())
    say(f"check: seed {seed} (reproduce with --seed {seed})")
    home = Path(tempfile.mkdtemp(prefix=f"icebarrier-check-{seed}-"))
    if failover:
        from icebarrier.apps.pg_pair import PostgresPair

        if not restarts:
            raise click.UsageError(
                "--failover fails the primary over where --restarts would restart it; drop --no-restarts"
            )
        server = PostgresPair(home / "pg")
        say(f"check: starting a private Postgres primary and synchronous standby under {home} …")
    else:
        server = EmbeddedPostgres(state_dir=home / "pg")
        say(f"check: starting a private embedded Postgres under {home} …")
    stack = contextlib.ExitStack()
    try:
        bootstrap = ""
        if kafka:
            from icebarrier.apps.kafka_broker import Broker

            say("check: starting a Kafka broker …")
            broker = stack.enter_context(_broker(Broker(home / "kafka"), f"check_{seed}_orders"))
            bootstrap = broker.bootstrap
        dsn = server.start().dsn() if failover else server.start()
        env = private_env(dsn, home, seed, warehouse=warehouse, storage=storage, kafka=bootstrap)
        upgrade(env.settings)
        report = CheckReport(seed=seed)
        with _live(report, duration_s, say) as line:
            run_check(
                env,
                duration_s=duration_s,
                fault_rate=fault_rate,
                server=server if restarts else None,
                progress=line,
                report=report,
                exec_jobs=exec_jobs,
                mutation=mutation,
                maintain=maintain,
                fail_fast=fail_fast,
            )
    finally:
        stack.close()
        server.stop()
        if keep:
            say(f"check: kept {home} (start its Postgres with pg_ctl -D {home / 'pg' / 'pgdata'} start)")
        else:
            shutil.rmtree(home, ignore_errors=True)
            if warehouse:
                remove_tree(warehouse, storage.fileio())

    def text() -> str:
        rows = [(lvl, report.reads[lvl], report.anomalies[lvl], report.examples.get(lvl, "-")) for lvl in report.reads]
        faults = ", ".join(f"{k} x{v}" for k, v in sorted(report.faults.items()) if v) or "none"
        waited = report.waited()
        lines = [
            f"seed {report.seed}: {report.barriers} barriers issued, {report.validated} validated "
            f"(coverage {report.coverage:.0%}, floor {report.coverage_floor:.0%}; excused: "
            + (", ".join(f"{k} x{v}" for k, v in report.excused.items()) or "none")
            + ")",
            table(["level", "reads", "anomalies", "example"], rows),
            f"no valid cut yet: {report.no_valid_cut} read(s); read-uncommitted errors: {report.read_uncommitted_errors}",
            "completions: "
            + (", ".join(f"{k} x{v}" for k, v in sorted(report.completions.items())) or "none")
            + f"; cuts refused at coalesced barriers: {report.coalesced_refused}; anchors validated: "
            f"{report.anchors_validated}",
            f"repeatable-read: {report.rr_sessions} session(s), {report.leases_renewed} lease renewal(s), "
            f"{report.leases_lost} lease(s) lost (reads stopped), {report.leases_refused} refused",
            (
                "maintenance service (killed and restarted, aggressive policies): "
                + (", ".join(f"{k} x{v}" for k, v in sorted(report.maintenance.items())) or "nothing ran")
                if report.maintenance is not None
                else f"expiry (own process, racing the readers): {report.expiry_runs} run(s), "
                f"{report.snapshots_expired} snapshot(s) expired"
            ),
            f"faults injected: {faults}; Postgres restarts: {report.restarts}"
            + (f" (failovers: {report.failovers})" if report.failovers else "")
            + (
                "; orders_in read a Kafka topic (aborted transactions beside each barrier's orders)"
                if report.kafka
                else ""
            ),
            f"catalog server ({', '.join(report.exec_jobs) or 'no job exec jobs'} under job exec"
            + (f"; mutation {report.mutation}" if report.mutation else "")
            + f"): {report.catalog_reads} "
            f"read-committed read(s), {report.catalog_anomalies} anomal(ies), {report.catalog_validated} cut(s) "
            f"validated through barrier-<B>, {report.catalog_unavailable} read(s) found it down"
            + (
                f"; SIGTERM to exit: longest {max(report.catalog_stop_s):.1f}s of {len(report.catalog_stop_s)}"
                if report.catalog_stop_s
                else ""
            )
            + (f"; example: {report.examples['catalog read-committed']}" if report.catalog_anomalies else ""),
            "reconnects after restarts: "
            + (
                ", ".join(
                    f"{who} x{w['reconnects']} (longest {w['max_wait_s']:.1f}s)" for who, w in sorted(waited.items())
                )
                or "none"
            ),
        ]
        lines += [f"VIOLATION: {v}" for v in report.violations]
        lines.append("OK" if report.ok else f"FAILED (reproduce with --seed {report.seed})")
        return "\n".join(lines)

    emit(obj, report.to_json(), text)
    if not report.ok:
        sys.exit(1)


def _live(report, duration_s: float, say):
    """On a terminal, one live line under the run's messages: elapsed against --duration, then
    the final validation; barriers issued and validated, reads, anomalies, faults, restarts.
    Elsewhere (a pipe, CI) the messages alone."""
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    from icebarrier.control_plane.model import Level

    bars = terminal_progress(TextColumn("check"), BarColumn(), TimeElapsedColumn(), TextColumn("{task.description}"))
    if bars is None:
        return contextlib.nullcontext(say)
    task = bars.add_task("starting the jobs", total=duration_s)

    def status() -> str:
        uncommitted = report.anomalies[Level.READ_UNCOMMITTED.value]
        consistent = sum(report.anomalies.values()) - uncommitted
        return (
            f"{report.barriers} barriers issued, {report.validated} validated, {sum(report.reads.values())} "
            f"reads ({consistent} anomalies at consistent levels, {uncommitted} read-uncommitted), "
            f"{sum(report.faults.values())} faults, {report.restarts} restarts"
        )

    @contextlib.contextmanager
    def live():
        done, started = threading.Event(), time.monotonic()

        def refresh() -> None:
            while not done.wait(0.5):
                elapsed = time.monotonic() - started
                phase = "final validation: " if elapsed > duration_s else ""
                bars.update(task, completed=min(elapsed, duration_s), description=phase + status())

        with bars:
            watcher = threading.Thread(target=refresh, name="check-progress", daemon=True)
            watcher.start()
            try:
                yield above(bars)
            finally:
                done.set()
                watcher.join()

    return live()


COMMANDS = [check]
