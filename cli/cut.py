"""``icebarrier cut``: a consistent snapshot per table."""

from __future__ import annotations

import click

from icebarrier.cli.render import BARRIER, barrier_label, emit, table
from icebarrier.control_plane import leases, reads
from icebarrier.control_plane.model import Cut, Level, TableName, parse_duration_s

LEVELS = [level.value for level in Level]


def wait_option(command):
    """``--wait``: how long a read waits for the tables' first consistent cut."""
    return click.option(
        "--wait",
        "wait",
        default="30s",
        show_default=True,
        help="Wait this long for a first consistent cut (0s: fail at once); a line on stderr "
        "names the job being waited for.",
    )(command)


def wait_for_first_cut(obj, names: list[TableName], level: Level, barrier: int | None, wait: str) -> None:
    """Before a read that needs a valid cut, wait (bounded) for the first one."""
    timeout_s = parse_duration_s(wait, allow_zero=True)
    if barrier is None and level is not Level.READ_UNCOMMITTED and timeout_s > 0:
        reads.wait_for_cut(obj.conn(), names, timeout_s=timeout_s, progress=lambda line: click.echo(line, err=True))


def cut_heading(cut: Cut) -> str:
    if cut.barrier is None:  # read-uncommitted: no alignment
        return f"level {cut.level.value}: each table's latest snapshot, no barrier"
    return f"level {cut.level.value}, barrier {barrier_label(cut.barrier)}"


def render_cut(cut: Cut) -> str:
    head = cut_heading(cut)
    if cut.lease_id:
        head += f"\nlease {cut.lease_id} until {cut.expires_at.isoformat()}"
    rows = [(str(t), s if s is not None else "(empty)") for t, s in sorted(cut.snapshots.items())]
    return head + "\n" + table(["table", "snapshot"], rows)


@click.command("cut")
@click.argument("table_names", metavar="TABLE...", nargs=-1, required=True)
@click.option("--level", type=click.Choice(LEVELS), default=Level.READ_COMMITTED.value, show_default=True)
@click.option("--barrier", type=BARRIER, help="The cut at this past barrier (refused if not valid for these tables).")
@click.option("--ttl", default="10m", show_default=True, help="Lease TTL for repeatable-read.")
@click.option("--holder", default="cli", show_default=True, help="Lease holder for repeatable-read.")
@wait_option
@click.pass_obj
def cut(obj, table_names, level: str, barrier: int | None, ttl: str, holder: str, wait: str) -> None:
    """Resolve a cut over TABLE...: the barrier and a snapshot id per table.

    read-committed is the latest valid cut; read-uncommitted each table's latest snapshot;
    repeatable-read acquires a lease that pins the cut (release it with `lease release`).
    """
    names, ttl_s = [TableName.parse(t) for t in table_names], parse_duration_s(ttl)
    wait_for_first_cut(obj, names, Level(level), barrier, wait)
    if Level(level) is Level.REPEATABLE_READ:
        result = leases.acquire(obj.conn(), names, ttl_s=ttl_s, holder=holder, barrier=barrier)
    else:
        result = reads.resolve(obj.conn(), names, level=Level(level), barrier=barrier)
    emit(obj, result.to_json(), lambda: render_cut(result))


COMMANDS = [cut]
