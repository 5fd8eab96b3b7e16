"""``icebarrier namespace``: the catalog's namespaces, made by the admin. A job's token creates
only tables (its sinks) and a reader's nothing; a grant names a namespace that exists. So the
namespace of a new pipeline's sinks is the admin's to make, before its tokens are granted."""

from __future__ import annotations

import click

from icebarrier.cli.catalog import parse_namespace
from icebarrier.cli.render import emit
from icebarrier.control_plane.model import quote_name, sql_levels


@click.group("namespace")
def namespace_group() -> None:
    """The catalog's namespaces: make those a pipeline's sinks live in."""


@namespace_group.command("create")
@click.argument("names", metavar="NAMESPACE...", nargs=-1, required=True)
@click.pass_obj
def create(obj, names) -> None:
    """Create each NAMESPACE in the catalog (`a.b`: the level b under a; `` `a.b` ``: one level
    named a.b); one that exists is left as it is. Every name is checked before any is made."""
    wanted = [parse_namespace(n) for n in names]
    catalog = obj.catalog()
    made, existed = [], []
    for namespace in wanted:
        if catalog.namespace_exists(sql_levels(namespace)):
            existed.append(quote_name(namespace))
        else:
            catalog.create_namespace(sql_levels(namespace))
            made.append(quote_name(namespace))
    lines = [*(f"namespace {n}: created" for n in made), *(f"namespace {n}: exists already" for n in existed)]
    emit(obj, {"created": made, "existed": existed}, "\n".join(lines))


COMMANDS = [namespace_group]
