"""``icebarrier schedule``: run the pipeline to meet the tables' target lags."""

from __future__ import annotations

import signal

import click

from icebarrier.cli.job import catalog_access
from icebarrier.cli.render import Seconds, emit, table


@click.command("schedule")
@click.option("--parallel", type=click.IntRange(1, 256), default=4, show_default=True, help="Runs at once, at most.")
@click.option("--dry-run", is_flag=True, help="Print the plan (which tables fall due when, running what) and exit.")
@catalog_access("An admin token, for the runs of jobs registered with --command")
@click.option(
    "--no-barriers",
    is_flag=True,
    help="Do not issue barriers on the clock (root jobs running --follow, or an operator, issue them).",
)
@click.pass_obj
def schedule(obj, parallel: int, dry_run: bool, catalog_uri, credential, ca_cert, no_barriers: bool) -> None:
    """Run each job `--once` (as registered with `job register --command/--file`) when a table
    downstream of it would otherwise miss its target lag, and not earlier, so that everything
    since its last run is coalesced. One schedule per control plane: a second one waits and
    takes over when the first stops. SIGINT/SIGTERM stop it (runs in flight are stopped)."""
    from icebarrier.apps import schedule as scheduling

    if dry_run:
        dues = scheduling.dry_run(obj.conn())
        emit(
            obj,
            [d.to_json() for d in dues],
            lambda: table(
                ["table", "target", "freshness", "refresh takes", "due in", "runs"],
                [
                    (
                        d.table + ("" if d.target_from == d.table else f" <- {d.target_from}"),
                        Seconds(d.target_s),
                        None if d.freshness_s is None else Seconds(d.freshness_s),
                        Seconds(d.refresh_s),
                        "now" if d.due_in_s <= 0 else Seconds(d.due_in_s),
                        " -> ".join(d.jobs)
                        + (f"  (no runner: {', '.join(d.missing)})" if d.missing else "")
                        + ("" if d.reachable else "  (target shorter than its refresh: unreachable)"),
                    )
                    for d in dues
                ],
                empty="no table has a target lag; set one with `icebarrier table target-lag TABLE 5m`",
            ),
        )
        return
    settings = obj.settings()
    runner = scheduling.Schedule(
        dsn=settings.dsn,
        schema=settings.schema,
        catalog_uri=catalog_uri,
        credential=credential,
        ca_cert=ca_cert,
        parallel=parallel,
        issue_barriers=not no_barriers,
        log=lambda line: click.echo(line, err=True),
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: runner.stop())
    runner.run()


COMMANDS = [schedule]
