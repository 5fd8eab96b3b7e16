"""``icebarrier table``, ``topology`` and ``lineage``: what the pipeline looks like."""

from __future__ import annotations

import json

import click

from icebarrier.cli.render import Seconds, barrier_label, emit, table
from icebarrier.control_plane import jobs, tables, topology
from icebarrier.control_plane.model import TableName


@click.group("table")
def table_group() -> None:
    """Inspect managed tables."""


@table_group.command("list")
@click.pass_obj
def list_(obj) -> None:
    """List managed tables: kind, writer, watermark, current snapshot, freshness, lag."""
    items = tables.list_versions(obj.conn())
    emit(
        obj,
        [v.to_json() for v in items],
        lambda: table(
            ["table", "kind", "writer", "watermark", "snapshot", "freshness", "behind"],
            [
                (
                    str(v.name),
                    v.kind,
                    v.writer_job,
                    barrier_label(v.watermark),
                    v.current_snapshot_id,
                    Seconds(v.freshness.total_seconds()) if v.freshness is not None else None,
                    v.barriers_behind,
                )
                for v in items
            ],
            empty="no managed tables; register a job first",
        ),
    )


@click.command("topology")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "dot", "mermaid", "json"]),
    default="text",
    show_default=True,
    help="text for people, dot (Graphviz) or mermaid to render, json for scripts.",
)
@click.pass_obj
def topology_cmd(obj, fmt: str) -> None:
    """Print the pipeline: inputs -> jobs -> tables."""
    definitions = list(jobs.load_definitions(obj.conn()).values())
    edges = topology.edges_of(definitions)
    if fmt == "json" or obj.output == "json":
        click.echo(
            json.dumps(
                [
                    {
                        "from_node": e.from_node,
                        "to_node": e.to_node,
                        "edge_kind": e.edge_kind,
                        "from_kind": e.from_kind,
                        "to_kind": e.to_kind,
                    }
                    for e in edges
                ],
                indent=2,
            )
        )
    elif fmt == "dot":
        click.echo(topology.render_dot(edges))
    elif fmt == "mermaid":
        click.echo(topology.render_mermaid(edges))
    else:
        click.echo(topology.render_text(definitions) or "no jobs registered")


@click.command("lineage")
@click.argument("table_name", metavar="TABLE")
@click.option("--upstream", "direction", flag_value="upstream", help="Tables TABLE is computed from.")
@click.option(
    "--downstream", "direction", flag_value="downstream", default=True, help="Tables computed from TABLE (default)."
)
@click.pass_obj
def lineage(obj, table_name: str, direction: str) -> None:
    """Tables upstream or downstream of TABLE, nearest first, with the job on each hop."""
    name = TableName.parse(table_name)
    steps = tables.lineage(obj.conn(), name, direction=direction)
    emit(
        obj,
        {
            "table": str(name),
            "direction": direction,
            "steps": [{"table": str(s.table), "job": s.job, "depth": s.depth} for s in steps],
        },
        lambda: table(
            ["depth", "table", "via job"],
            [(s.depth, str(s.table), s.job) for s in steps],
            empty=f"nothing {direction} of {name}",
        ),
    )


COMMANDS = [table_group, topology_cmd, lineage]
