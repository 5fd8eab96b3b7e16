"""``icebarrier maintain``, ``expire``, ``remove-orphans``, ``compact``, ``reconcile``, ``revise`` and ``tag``."""

from __future__ import annotations

import click

from icebarrier.cli.cut import render_cut
from icebarrier.cli.render import BARRIER, emit, table
from icebarrier.control_plane import tables
from icebarrier.control_plane.model import TableName, barrier_label, parse_duration_s, parse_tag_name


def _named_or_all(conn, table_names) -> list[TableName]:
    """The tables named with --table, else every managed table."""
    return [TableName.parse(t) for t in table_names] or [v.name for v in tables.list_versions(conn)]


@click.command("maintain")
@click.option(
    "--every",
    default="5s",
    show_default=True,
    help="How often it looks at the tables (a table without a commit is looked at when its time comes).",
)
@click.option(
    "--once", is_flag=True, help="One pass over the tables, print what ran, exit (no lock: for cron or a test)."
)
@click.option(
    "--table", "table_names", multiple=True, metavar="TABLE", help="Only these tables of the catalog (default: all)."
)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Tables looked at and maintained at a time (each worker a control-plane connection; one Spark "
    "session serves them all), the longest due first.",
)
@click.pass_obj
def maintain(obj, every: str, once: bool, table_names, workers: int) -> None:
    """Keep every table within its maintenance policy (`icebarrier table maintenance`): expire
    snapshots outside the protected set, compact small files (keeping their barrier), rewrite
    manifests, remove orphans and old metadata files. One per control plane: a second one waits
    and takes over when the first stops. SIGINT/SIGTERM stop it after the action in flight."""
    import signal

    from icebarrier.apps.maintain import Maintainer
    from icebarrier.control_plane.errors import InvalidValueError
    from icebarrier.iceberg_ext.catalog import pointers as catalog_pointers

    tick_s = parse_duration_s(every)
    only = frozenset(TableName.parse(t) for t in table_names) or None
    for name in only or ():
        if not catalog_pointers(obj.conn(), obj.settings(), only=name):
            raise InvalidValueError(f"table {name} is not in the catalog; check --table (catalog.namespace.table)")
    service = Maintainer(
        obj.settings(),
        tick_s=tick_s,
        log=lambda line: click.echo(line, err=True),
        spark_factory=lambda: obj.spark("icebarrier-maintain"),
        only=only,
        workers=workers,
    )
    if once:
        actions = service.once(obj.conn(), obj.catalog())
        emit(
            obj,
            [{"table": str(a.table), "action": a.action, "result": a.result, "detail": a.detail} for a in actions],
            lambda: "\n".join(a.line() for a in actions) or "nothing was due",
        )
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: service.stop())
    service.run()


@click.command("expire")
@click.option(
    "--table", "table_names", multiple=True, metavar="TABLE", help="Only these tables of the catalog (default: all)."
)
@click.option("--older-than", help="Only snapshots older than this (e.g. 7d); default: any age.")
@click.option(
    "--retain-last",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Keep the newest N snapshots regardless.",
)
@click.option("--dry-run", is_flag=True, help="Show what would be expired and why the rest is kept.")
@click.pass_obj
def expire(obj, table_names, older_than: str | None, retain_last: int, dry_run: bool) -> None:
    """Expire snapshots outside the protected set (leases, downstream job progress, current,
    the read-committed window, retention, tags), deleting files nothing references any more."""
    from icebarrier.iceberg_ext.maintenance import expire as run

    older = parse_duration_s(older_than, allow_zero=True) if older_than else None
    conn, catalog = obj.conn(), obj.catalog()
    names = _named_or_all(conn, table_names)
    reports = [run(conn, catalog, t, older_than_s=older, retain_last=retain_last, dry_run=dry_run) for t in names]
    emit(
        obj,
        [r.to_json() for r in reports],
        lambda: table(
            ["table", "candidates", "expired" if not dry_run else "would expire", "kept", "files deleted"],
            [(str(r.table), r.candidates, len(r.expired), len(r.protected), r.files_deleted) for r in reports],
        ),
    )


@click.command("remove-orphans")
@click.option(
    "--table", "table_names", multiple=True, metavar="TABLE", help="Only these tables of the catalog (default: all)."
)
@click.option(
    "--older-than",
    default="3d",
    show_default=True,
    help="Only files last modified longer ago than this (files of a write in flight are not referenced yet).",
)
@click.option("--dry-run", is_flag=True, help="List the orphans without deleting them.")
@click.pass_obj
def remove_orphans(obj, table_names, older_than: str, dry_run: bool) -> None:
    """Delete files under each table's location that no snapshot, metadata file or staged commit
    references (failed and killed runs leave them), older than --older-than and than any job
    session or staging of the table still open. Works on a local warehouse and on S3."""
    from icebarrier.iceberg_ext.orphans import remove_orphans as run

    older = parse_duration_s(older_than, allow_zero=True)
    conn, catalog, schema = obj.conn(), obj.catalog(), obj.settings().catalog_schema
    names = _named_or_all(conn, table_names)
    reports = [run(conn, catalog, t, catalog_schema=schema, older_than_s=older, dry_run=dry_run) for t in names]
    emit(
        obj,
        [r.to_json() for r in reports],
        lambda: table(
            ["table", "files", "orphans" if dry_run else "deleted", "kept (recent)", "metadata files", "data files"],
            [(str(r.table), r.listed, len(r.orphans), r.kept_recent, r.metadata_files, r.data_files) for r in reports],
        ),
    )


@click.command("compact")
@click.argument("table_name", metavar="TABLE")
@click.option("--min-input-files", type=click.IntRange(1), default=2, show_default=True)
@click.pass_obj
def compact(obj, table_name: str, min_input_files: int) -> None:
    """Rewrite small files of TABLE (Spark); the new snapshot keeps the barrier it compacted."""
    from icebarrier.iceberg_ext.maintenance import compact as run

    name, conn = TableName.parse(table_name), obj.conn()
    tables.require(conn, name)  # before starting Spark (seconds) for a table that is not there
    report = run(obj.spark(), conn, obj.catalog(), name, min_input_files=min_input_files)
    emit(
        obj,
        report.to_json(),
        f"{report.table}: compacted at barrier {barrier_label(report.barrier)} into snapshot {report.snapshot_id}"
        if report.snapshot_id
        else f"{report.table}: nothing to compact",
    )


@click.command("reconcile")
@click.argument("table_names", metavar="[TABLE]...", nargs=-1)
@click.pass_obj
def reconcile(obj, table_names) -> None:
    """Compare the control plane with the tables' snapshot summaries: adopt missing records,
    list commits awaiting their job, and report snapshots written by anyone else (exit 1)."""
    import sys

    from icebarrier.iceberg_ext.maintenance import reconcile as run

    conn, catalog = obj.conn(), obj.catalog()
    names = [TableName.parse(t) for t in table_names] or [v.name for v in tables.list_versions(conn)]
    reports = [run(conn, catalog, t) for t in names]

    def text() -> str:
        rows = []
        for r in reports:
            rows += [(str(r.table), "adopted", s, f"barrier {b}") for b, s in r.adopted]
            rows += [(str(r.table), "pending", s, f"barrier {b}, awaits job {j}") for b, s, j in r.pending]
            rows += [(str(r.table), "VIOLATION", s, why) for s, why in r.foreign]
            rows += [(str(r.table), "MISSING", s, "recorded but not in Iceberg") for s in r.missing_in_iceberg]
        return table(["table", "status", "snapshot", "detail"], rows, empty="control plane and tables agree")

    emit(obj, [r.to_json() for r in reports], text)
    bad = [r for r in reports if not r.ok]
    if bad:
        click.echo(
            f"error: single-writer violations or missing snapshots in {', '.join(str(r.table) for r in bad)}", err=True
        )
        sys.exit(1)


@click.command("revise")
@click.argument("table_name", metavar="TABLE")
@click.option("--to-barrier", type=BARRIER, required=True, help="Roll back to the state at this barrier.")
@click.option("--dry-run", is_flag=True, help="Print the plan only.")
@click.pass_obj
def revise(obj, table_name: str, to_barrier: int, dry_run: bool) -> None:
    """Roll TABLE and everything downstream back to their snapshots at a barrier, reset
    watermarks and job progress; jobs then recompute the barriers after it."""
    from icebarrier.iceberg_ext.maintenance import revise as run

    plan = run(obj.conn(), obj.catalog(), TableName.parse(table_name), to_barrier, dry_run=dry_run)

    def text() -> str:
        head = f"{'plan' if dry_run else 'revised'}: {plan.root} and downstream to barrier {barrier_label(plan.to_barrier)}"
        rows = [
            (
                str(t.table),
                f"{t.from_watermark} -> {t.to_watermark}",
                f"{t.from_snapshot} -> {t.to_snapshot}",
                t.writer_job,
                "yes" if t.changes else "no",
            )
            for t in plan.tables
        ]
        body = table(["table", "watermark", "snapshot", "job", "changes"], rows)
        return f"{head}\n{body}\njobs reset: {', '.join(plan.jobs_reset) or '(none)'}"

    emit(obj, {**plan.to_json(), "dry_run": dry_run}, text)


@click.command("tag")
@click.argument("name")
@click.argument("table_names", metavar="TABLE...", nargs=-1, required=True)
@click.option("--barrier", type=BARRIER, help="Tag the cut at this barrier (default: the latest valid cut).")
@click.option("--max-age", help="Let the tag expire after this long (e.g. 30d).")
@click.pass_obj
def tag(obj, name: str, table_names, barrier: int | None, max_age: str | None) -> None:
    """Create Iceberg tag NAME on each TABLE at the cut's snapshot; any engine can then read
    the consistent cut with VERSION AS OF 'NAME'."""
    from icebarrier.iceberg_ext.maintenance import tag as run

    name, names = parse_tag_name(name), [TableName.parse(t) for t in table_names]
    max_age_s = parse_duration_s(max_age) if max_age else None
    cut = run(obj.conn(), obj.catalog(), name, names, barrier=barrier, max_age_s=max_age_s)
    emit(obj, {"tag": name, **cut.to_json()}, lambda: f"tag {name}\n" + render_cut(cut))


COMMANDS = [maintain, expire, remove_orphans, compact, reconcile, revise, tag]
