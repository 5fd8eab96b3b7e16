"""``icebarrier input``: announce data arriving in external inputs, list and forget them."""

from __future__ import annotations

import click

from icebarrier.cli.render import emit, table
from icebarrier.control_plane import inputs


@click.group("input")
def input_group() -> None:
    """External inputs announced by whoever lands their data: a root job reading only announced
    inputs runs at a barrier only when one was announced since its last; the control plane
    skips its other barriers without it."""


@input_group.command("announce")
@click.argument("names", nargs=-1, required=True)
@click.pass_obj
def announce(obj, names: tuple[str, ...]) -> None:
    """Data arrived in NAMES (e.g. kafka:orders): their root jobs run at the next barrier.

    The first announcement makes an input announced: from then on its jobs run only after an
    announcement, so announce after every arrival (`icebarrier input forget` undoes it)."""
    inputs.announce(obj.conn(), list(names))
    emit(obj, {"announced": sorted(set(names))}, f"announced {', '.join(sorted(set(names)))}")


@input_group.command("forget")
@click.argument("names", nargs=-1, required=True)
@click.pass_obj
def forget(obj, names: tuple[str, ...]) -> None:
    """NAMES are no longer announced: the root jobs reading them run at every barrier again."""
    n = inputs.forget(obj.conn(), list(names))
    emit(obj, {"forgotten": n}, f"forgot {n} announced input(s)")


@input_group.command("list")
@click.pass_obj
def list_(obj) -> None:
    """The announced inputs, when each was last announced, and the jobs that read it."""
    items = inputs.list_inputs(obj.conn())
    emit(
        obj,
        [i.to_json() for i in items],
        lambda: table(
            ["input", "announced_at", "announced_by", "jobs"],
            [(i.name, i.announced_at.isoformat(timespec="seconds"), i.announced_by, ", ".join(i.jobs)) for i in items],
        ),
    )


COMMANDS = [input_group]
