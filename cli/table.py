"""``icebarrier table``, ``topology`` and ``lineage``: what the pipeline looks like."""

from __future__ import annotations

import json

import click

from icebarrier.cli.render import Seconds, barrier_label, emit, table
from icebarrier.control_plane import jobs, tables, targets, topology
from icebarrier.control_plane.model import TableName, parse_duration_s


@click.group("table")
def table_group() -> None:
    """Inspect managed tables."""


@table_group.command("list")
@click.pass_obj
def list_(obj) -> None:
    """List managed tables: kind, writer, watermark, current snapshot, freshness, lag, and the
    target lag (inherited: `<- TABLE`) with whether it is met."""
    conn = obj.conn()
    items = tables.list_versions(conn)
    goals = {str(t.name): t for t in targets.targets(conn)}
    emit(
        obj,
        [{**v.to_json(), **_target_json(goals.get(str(v.name)))} for v in items],
        lambda: table(
            ["table", "kind", "writer", "watermark", "snapshot", "freshness", "behind", "target"],
            [
                (
                    str(v.name),
                    v.kind,
                    v.writer_job,
                    barrier_label(v.watermark),
                    v.current_snapshot_id,
                    Seconds(v.freshness.total_seconds()) if v.freshness is not None else None,
                    v.barriers_behind,
                    _target_text(goals.get(str(v.name))),
                )
                for v in items
            ],
            empty="no managed tables; register a job first",
        ),
    )


def _target_json(t: targets.TableTarget | None) -> dict:
    if t is None:
        return {}
    return {k: v for k, v in t.to_json().items() if k not in ("table", "writer_job", "freshness_s")}


def _target_text(t: targets.TableTarget | None) -> str | None:
    if t is None or t.effective_s is None:
        return None
    inherited = "" if t.target_lag_s is not None else f" <- {t.target_from}"
    return f"{t.effective_s:g}s{inherited} {'met' if t.met else 'MISSED'}"


@table_group.command("target-lag")
@click.argument("name", metavar="TABLE")
@click.argument("duration", required=False)
@click.option("--clear", is_flag=True, help="Remove the table's own target (it inherits again).")
@click.pass_obj
def target_lag(obj, name: str, duration: str | None, clear: bool) -> None:
    """Set TABLE's target lag: at any moment its watermark was issued at most DURATION ago
    (e.g. 5m). `icebarrier schedule` runs the pipeline to meet it. A table without its own
    target inherits the tightest target of the tables that read it."""
    if clear == (duration is not None):
        raise click.UsageError("give a DURATION (e.g. 5m) or --clear")
    seconds = None if clear else parse_duration_s(duration)
    table_name = TableName.parse(name)
    targets.set_target_lag(obj.conn(), table_name, seconds)
    emit(
        obj,
        {"table": name, "target_lag_s": seconds},
        f"table {name}: target lag {f'{seconds:g}s' if seconds is not None else 'cleared'}",
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
