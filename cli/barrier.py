"""``icebarrier barrier``: issue and list barriers, set the barrier and anchor intervals."""

from __future__ import annotations

import click

from icebarrier.cli.render import barrier_label, duration, emit, table
from icebarrier.control_plane import barriers
from icebarrier.control_plane.model import parse_duration_s


def _barrier_json(b) -> dict:
    return {"barrier": b.barrier, "issued_at": b.issued_at.isoformat(), "issued_by": b.issued_by, "anchor": b.anchor}


@click.group("barrier")
def barrier_group() -> None:
    """Issue and list barriers (cut lines through the pipeline's input)."""


@barrier_group.command("issue")
@click.pass_obj
def issue(obj) -> None:
    """Issue a barrier now, from the control plane's database clock."""
    b = barriers.issue(obj.conn())
    emit(obj, _barrier_json(b), f"issued barrier {barrier_label(b.barrier)}{' (an anchor)' if b.anchor else ''}")


@barrier_group.command("list")
@click.option("--limit", type=click.IntRange(1, 100_000), default=20, show_default=True, help="Newest N barriers.")
@click.pass_obj
def list_(obj, limit: int) -> None:
    """List the newest barriers."""
    items = barriers.list_barriers(obj.conn(), limit=limit)
    emit(
        obj,
        [_barrier_json(b) for b in items],
        lambda: table(
            ["barrier", "issued_at", "issued_by", "anchor"],
            [(b.barrier, b.issued_at.isoformat(), b.issued_by, "anchor" if b.anchor else "") for b in items],
        ),
    )


@barrier_group.command("interval", context_settings={"ignore_unknown_options": True})  # "-5s" is a value
@click.argument("duration_text", metavar="[DURATION]", required=False)
@click.pass_obj
def interval(obj, duration_text: str | None) -> None:
    """Show or set the barrier interval (e.g. 10s, 500ms, 1m).

    A root job asking for its next barrier gets a new one when the newest is older than this.
    """
    conn = obj.conn()
    seconds = (
        barriers.set_interval_s(conn, parse_duration_s(duration_text))
        if duration_text
        else barriers.get_interval_s(conn)
    )
    emit(obj, {"barrier_interval_s": seconds}, f"barrier interval: {duration(seconds)}")


@barrier_group.command("anchor-interval", context_settings={"ignore_unknown_options": True})
@click.argument("duration_text", metavar="[DURATION]", required=False)
@click.pass_obj
def anchor_interval(obj, duration_text: str | None) -> None:
    """Show or set the anchor interval (default 60s).

    The first barrier issued at or after each multiple of it, on the database clock, is an
    anchor: no job coalesces it, so every table completes every anchor and any tables have a
    valid cut at each anchor they have passed.
    """
    conn = obj.conn()
    seconds = (
        barriers.set_anchor_interval_s(conn, parse_duration_s(duration_text))
        if duration_text
        else barriers.get_anchor_interval_s(conn)
    )
    emit(obj, {"anchor_interval_s": seconds}, f"anchor interval: {duration(seconds)}")


COMMANDS = [barrier_group]
