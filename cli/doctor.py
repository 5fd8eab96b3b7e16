"""``icebarrier doctor``: what in the lake breaks today's rules (left by earlier versions)."""

from __future__ import annotations

import sys

import click

from icebarrier.cli.render import emit, table


@click.command("doctor")
@click.pass_obj
def doctor(obj) -> None:
    """List the namespaces and tables of the catalog whose names break the names rule (1 to 128
    characters, not blank, no '.', '/' or control characters; a namespace at most 255 characters
    dotted). Earlier versions let some through; rename each table to a name the rule allows
    (`POST /v1/{prefix}/tables/rename` takes the old name as its source). Exits 1 if any."""
    from icebarrier.iceberg_ext.catalog import names_breaking_rule

    found = names_breaking_rule(obj.settings())
    emit(
        obj,
        [{"kind": k, "name": n, "why": w} for k, n, w in found],
        lambda: table(["kind", "name", "why"], found, empty="every name keeps the names rule"),
    )
    if found:
        sys.exit(1)


COMMANDS = [doctor]
