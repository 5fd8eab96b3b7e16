"""``icebarrier table``, ``topology`` and ``lineage``: what the pipeline looks like."""

from __future__ import annotations

import json
from datetime import datetime

import click

from icebarrier.cli.render import Seconds, ago, barrier_label, emit, page, paging, table
from icebarrier.control_plane import jobs, tables, targets, topology, upkeep
from icebarrier.control_plane.model import (
    TableName,
    format_duration_s,
    format_size_bytes,
    parse_duration_s,
    parse_size_bytes,
)
from icebarrier.iceberg_ext.upkeep import enroll


@click.group("table")
def table_group() -> None:
    """Inspect managed tables."""


@table_group.command("list")
@paging
@click.pass_obj
def list_(obj, limit: int, after: str | None, everything: bool) -> None:
    """List managed tables: kind, writer, watermark, current snapshot, freshness, lag, and the
    target lag (inherited: `<- TABLE`) with whether it is met; by name, a page at a time."""
    conn = obj.conn()
    limit_ = None if everything else limit
    items = page(
        tables.list_versions(conn, after=after, limit=None if limit_ is None else limit_ + 1),
        limit=limit_,
        name=lambda v: str(v.name),
        what="tables",
        command="table list",
    )
    goals = {str(t.name): t for t in targets.targets(conn, after=after, limit=len(items) if limit_ else None)}
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


def _option(setting: str) -> str:
    """A policy setting's name on the command line: ``retain_s`` is ``retain``."""
    return setting.removesuffix("_s").replace("_", "-")


@table_group.command("maintenance")
@click.argument("name", metavar="TABLE")
@click.option("--retain", help="Snapshots older than this expire, outside the protected set (e.g. 1m, 1h, 7d).")
@click.option("--retain-last", type=int, help="The newest N snapshots stay whatever their age.")
@click.option("--target-file-size", help="Compaction writes files of this size (e.g. 128MB).")
@click.option("--compact-min-files", type=int, help="Compact when the current snapshot has this many small files.")
@click.option("--max-manifests", type=int, help="Rewrite manifests when the current snapshot has more than this.")
@click.option("--orphan-grace", help="An unreferenced data file is removed after this long (e.g. 3d).")
@click.option("--metadata-grace", help="An unreferenced metadata file is removed after this long (e.g. 10m).")
@click.option("--on/--off", "enabled", default=None, help="Maintain TABLE, or leave it alone.")
@click.option(
    "--default",
    "defaults",
    multiple=True,
    type=click.Choice([_option(k) for k in upkeep.SETTINGS]),
    help="Return this setting to the default (repeatable).",
)
@click.pass_obj
def maintenance(
    obj,
    name: str,
    retain,
    retain_last,
    target_file_size,
    compact_min_files,
    max_manifests,
    orphan_grace,
    metadata_grace,
    enabled,
    defaults,
) -> None:
    """Set TABLE's maintenance policy (what `icebarrier maintain` keeps and when it acts);
    settings not given stay as they are. With no settings, print the policy. TABLE may be any
    table of the catalog, managed by a job or not."""
    table_name = TableName.parse(name)
    settings: dict = {}
    if retain is not None:
        settings["retain_s"] = parse_duration_s(retain, allow_zero=True)
    for key, value in (
        ("retain_last", retain_last),
        ("compact_min_files", compact_min_files),
        ("max_manifests", max_manifests),
        ("enabled", enabled),
    ):
        if value is not None:
            settings[key] = value
    if target_file_size is not None:
        settings["target_file_size"] = parse_size_bytes(target_file_size)
    for key, value in (("orphan_grace_s", orphan_grace), ("metadata_grace_s", metadata_grace)):
        if value is not None:
            settings[key] = parse_duration_s(value)
    for option in defaults:
        key = next(k for k in upkeep.SETTINGS if _option(k) == option)
        if key in settings:
            raise click.UsageError(f"--{option} is both set and returned to the default; give one")
        settings[key] = None
    conn = obj.conn()
    enroll(conn, obj.settings(), table_name)  # a table of the catalog no job writes is maintained too
    if settings:
        policy = upkeep.set_policy(conn, table_name, settings)
    else:
        policy = upkeep.statuses(conn, [table_name])[0].policy
    emit(obj, policy.to_json(), lambda: _policy_text(policy))


def _policy_text(p: upkeep.Policy) -> str:
    def mark(key: str, text: str) -> str:
        return text if key in p.own else f"{text} (default)"

    rows = [
        ("maintained", mark("enabled", "yes" if p.enabled else "no")),
        ("retain", mark("retain", format_duration_s(p.retain_s))),
        ("keep the newest", mark("retain_last", f"{p.retain_last} snapshots")),
        ("target file size", mark("target_file_size", format_size_bytes(p.target_file_size))),
        ("compact at", mark("compact_min_files", f"{p.compact_min_files} small files")),
        ("rewrite manifests past", mark("max_manifests", str(p.max_manifests))),
        ("orphans after", mark("orphan_grace", format_duration_s(p.orphan_grace_s))),
        ("old metadata files after", mark("metadata_grace", format_duration_s(p.metadata_grace_s))),
    ]
    return "\n".join(f"{k + ':':26} {v}" for k, v in rows)


@table_group.command("show")
@click.argument("name", metavar="TABLE")
@click.pass_obj
def show(obj, name: str) -> None:
    """TABLE's writer, watermark, freshness and target, its maintenance policy, what the
    maintenance service saw at its last look, what it did last and what it will do next."""
    table_name, conn = TableName.parse(name), obj.conn()
    tables.require(conn, table_name)
    version = next(v for v in tables.list_versions(conn) if v.name == table_name)
    goal = next((t for t in targets.targets(conn) if t.name == table_name), None)
    status = upkeep.statuses(conn, [table_name])[0]
    payload = {**version.to_json(), **_target_json(goal), "maintenance": status.to_json()}

    def text() -> str:
        lines = [
            f"table {table_name} ({version.kind}), written by {version.writer_job or '-'}",
            f"watermark: {barrier_label(version.watermark)}, snapshot {version.current_snapshot_id}, "
            f"target {_target_text(goal) or '-'}",
            "maintenance:",
            *(f"  {line}" for line in _policy_text(status.policy).splitlines()),
        ]
        if status.checked_at is not None:
            seen = status.seen
            lines.append(
                f"  last look: {ago(status.checked_at)}: {seen['snapshots']} snapshots, {seen['data_files']} data files "
                f"({seen['small_files']} small), {seen['manifests']} manifests, metadata file "
                f"{format_size_bytes(seen['metadata_bytes'])}"
            )
            if status.files is not None:
                lines.append(
                    f"  files under it: {status.files.metadata + status.files.data} ({status.files.metadata} "
                    f"metadata, {status.files.data} data), counted {ago(status.files.counted_at)}"
                )
            lines.append(f"  next: {status.next}")
        else:
            lines.append("  not looked at yet (is `icebarrier maintain` running?)")
        for action, last in sorted(status.actions.items()):
            what = ", ".join(f"{k} {v}" for k, v in last["detail"].items())
            lines.append(
                f"  {action}: {last['result']} {ago(datetime.fromisoformat(last['at']))} ({what}); "
                f"{last['done']} done, {last['gave_way']} gave way, {last['failed']} failed"
            )
        return "\n".join(lines)

    emit(obj, payload, text)


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
