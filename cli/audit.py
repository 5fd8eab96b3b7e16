"""``icebarrier audit``: who did what, when, to which job or table (admins only)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import click

from icebarrier.cli.render import emit, table
from icebarrier.control_plane import audit as trail
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import TableName, parse_duration_s, parse_job_name


def _since(text: str | None) -> datetime | None:
    """``1h`` (that long ago) or an ISO 8601 time."""
    if text is None:
        return None
    try:
        return datetime.now(UTC) - timedelta(seconds=parse_duration_s(text))
    except IcebarrierError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise IcebarrierError(
            f"--since {text!r} is neither a duration (e.g. 1h, 2d) nor an ISO 8601 time (e.g. 2026-11-25T08:00:00Z)"
        ) from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


@click.command("audit")
@click.option("--since", help="Only events after this: a duration ago (1h, 2d) or an ISO 8601 time.")
@click.option("--job", help="Only events of this job.")
@click.option("--table", "table_name", metavar="TABLE", help="Only events of this table (catalog.namespace.name).")
@click.option(
    "--limit", type=click.IntRange(1, 100_000), default=1000, show_default=True, help="The newest this many events."
)
@click.pass_obj
def audit(obj, since: str | None, job: str | None, table_name: str | None, limit: int) -> None:
    """The audit trail, oldest first: jobs registered and unregistered, revisions, tokens,
    settings (barrier and anchor intervals among them), leases taken by hand, job sessions
    opened, taken over, published and released; who (role and actor), when, the result.
    Readable by the admin only."""
    events = trail.events(
        obj.conn(),
        since=_since(since),
        job=parse_job_name(job) if job else None,
        table=str(TableName.parse(table_name)) if table_name else None,
        limit=limit,
    )
    emit(
        obj,
        [e.to_json() for e in events],
        lambda: table(
            ["at", "who", "action", "job", "table", "object", "result"],
            [
                (
                    e.at.isoformat(timespec="seconds"),
                    e.actor or e.role,
                    e.action,
                    e.job or "",
                    e.table or "",
                    e.object or "",
                    e.result,
                )
                for e in events
            ],
            empty="no events",
        ),
    )


COMMANDS = [audit]
