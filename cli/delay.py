"""``icebarrier delay``: end-to-end delay, job delay, freshness, lag and the bottleneck."""

from __future__ import annotations

import click

from icebarrier.cli.render import Seconds, emit, table
from icebarrier.control_plane import delays, targets
from icebarrier.control_plane.model import TableName


@click.command("delay")
@click.option("--table", "table_name", metavar="TABLE", help="Only this table.")
@click.option("--job", "job_name", metavar="JOB", help="Only this job.")
@click.option(
    "--last", type=click.IntRange(1, 100_000), default=100, show_default=True, help="Over the last N barriers."
)
@click.pass_obj
def delay(obj, table_name: str | None, job_name: str | None, last: int) -> None:
    """Per table and per job: p50/p95/max delay over the last N barriers, freshness,
    barriers behind; the bottleneck job (largest median job delay) is flagged. Then the
    latest stretches in which a table was staler than its target lag (target misses)."""
    conn = obj.conn()
    table_rows = [] if job_name else delays.table_delays(conn, last=last, table=table_name)
    job_rows = [] if table_name else delays.job_delays(conn, last=last, job=job_name)
    misses = [] if job_name else targets.misses(conn, table=TableName.parse(table_name) if table_name else None)

    def text() -> str:
        headers = ["name", "barriers", "p50", "p95", "max", "freshness", "behind"]

        def row(d, flag=""):
            return (
                d.name + flag,
                d.barriers,
                *(None if v is None else Seconds(v) for v in (d.p50_s, d.p95_s, d.max_s, d.freshness_s)),
                d.barriers_behind,
            )

        parts = []
        if not job_name:
            parts.append("table delay (completion - barrier issue)\n" + table(headers, [row(d) for d in table_rows]))
        if not table_name:
            parts.append(
                "job delay (completion - inputs ready)\n"
                + table(headers, [row(d, "  <- bottleneck" if d.bottleneck else "") for d in job_rows])
            )
        if misses:
            parts.append(
                "target misses (staler than the target lag; newest first)\n"
                + table(
                    ["table", "target", "from", "until", "overdue"],
                    [
                        (
                            str(m.table),
                            Seconds(m.target_lag_s),
                            f"{m.since:%Y-%m-%d %H:%M:%S}",
                            f"{m.until:%H:%M:%S}" if m.until else "still",
                            Seconds(m.overdue_s),
                        )
                        for m in misses
                    ],
                )
            )
        return "\n\n".join(parts)

    emit(
        obj,
        {
            "tables": [d.to_json() for d in table_rows],
            "jobs": [d.to_json() for d in job_rows],
            "target_misses": [m.to_json() for m in misses],
        },
        text,
    )


COMMANDS = [delay]
