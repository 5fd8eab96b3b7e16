"""``icebarrier lease`` and ``protected``: pinning snapshots against expiry."""

from __future__ import annotations

import click

from icebarrier.cli.cut import render_cut, wait_for_first_cut, wait_option
from icebarrier.cli.render import BARRIER, duration, emit, table
from icebarrier.control_plane import leases
from icebarrier.control_plane.model import Level, TableName, parse_duration_s


@click.group("lease")
def lease_group() -> None:
    """Pin a consistent cut's snapshots for a holder until released or the TTL passes."""


@lease_group.command("max-ttl", context_settings={"ignore_unknown_options": True})  # "-5s" is a value
@click.argument("duration_text", metavar="[DURATION]", required=False)
@click.pass_obj
def max_ttl(obj, duration_text: str | None) -> None:
    """Show or set the longest TTL a lease may have when taken by a role other than the admin
    (e.g. 1h, 1d; at most 7d). Setting it is for the admin."""
    conn = obj.conn()
    seconds = (
        leases.set_max_ttl_s(conn, parse_duration_s(duration_text)) if duration_text else leases.get_max_ttl_s(conn)
    )
    emit(obj, {"lease_max_ttl_s": seconds}, f"lease max TTL (roles other than the admin): {duration(seconds)}")


@lease_group.command("acquire")
@click.argument("table_names", metavar="TABLE...", nargs=-1, required=True)
@click.option("--ttl", default="10m", show_default=True, help="Time to live without renewal (e.g. 30s, 10m, 2h).")
@click.option("--holder", default="cli", show_default=True, help="Who holds the lease (shown in lease list).")
@click.option("--barrier", type=BARRIER, help="Pin the cut at this barrier instead of the latest valid one.")
@wait_option
@click.pass_obj
def acquire(obj, table_names, ttl: str, holder: str, barrier: int | None, wait: str) -> None:
    """Pin the latest valid cut (or --barrier) over TABLE...; prints id, barrier, snapshots, expiry."""
    names, ttl_s = [TableName.parse(t) for t in table_names], parse_duration_s(ttl)
    wait_for_first_cut(obj, names, Level.REPEATABLE_READ, barrier, wait)
    result = leases.acquire(obj.conn(), names, ttl_s=ttl_s, holder=holder, barrier=barrier)
    emit(obj, result.to_json(), lambda: render_cut(result))


@lease_group.command("renew")
@click.argument("lease_id")
@click.option("--ttl", default="10m", show_default=True, help="New time to live from now.")
@click.pass_obj
def renew(obj, lease_id: str, ttl: str) -> None:
    """Extend a live lease; an expired or released lease cannot be renewed."""
    lease = leases.renew(obj.conn(), lease_id, ttl_s=parse_duration_s(ttl))
    emit(obj, lease.to_json(), f"lease {lease.lease_id} renewed until {lease.expires_at.isoformat()}")


@lease_group.command("release")
@click.argument("lease_id")
@click.pass_obj
def release(obj, lease_id: str) -> None:
    """Release a lease; its snapshots are no longer protected by it."""
    lease = leases.release(obj.conn(), lease_id)
    emit(obj, lease.to_json(), f"lease {lease.lease_id} released")


@lease_group.command("list")
@click.option("--all", "include_inactive", is_flag=True, help="Include released and expired leases.")
@click.pass_obj
def list_(obj, include_inactive: bool) -> None:
    """List live leases (or all with --all)."""
    items = leases.list_leases(obj.conn(), include_inactive=include_inactive)
    emit(
        obj,
        [lease.to_json() for lease in items],
        lambda: table(
            ["lease", "holder", "state", "barrier", "expires_at", "tables"],
            [(x.lease_id, x.holder, x.state, x.barrier, x.expires_at.isoformat(), len(x.snapshots)) for x in items],
            empty="no live leases",
        ),
    )


@click.command("protected")
@click.argument("table_name", metavar="TABLE")
@click.pass_obj
def protected(obj, table_name: str) -> None:
    """Snapshot ids of TABLE that expiry must keep, and why (lease / job progress / current / read-committed)."""
    name = TableName.parse(table_name)
    items = leases.protected(obj.conn(), name)
    emit(
        obj,
        {"table": str(name), "protected": {str(s): list(p.reasons) for s, p in items.items()}},
        lambda: table(
            ["snapshot", "why"],
            [(s, ", ".join(p.reasons)) for s, p in items.items()],
            empty=f"no protected snapshots recorded for {name}",
        ),
    )


COMMANDS = [lease_group, protected]
