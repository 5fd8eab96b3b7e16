"""``icebarrier spark-conf`` and ``query``: Spark with the icebarrier catalog."""

from __future__ import annotations

import click

from cli.cut import LEVELS
from cli.render import barrier_label, emit, table
from control_plane import tables
from control_plane.errors import IcebarrierError
from control_plane.model import Level, parse_duration_s


@click.command("spark-conf")
@click.option("--format", "fmt", type=click.Choice(["flags", "json", "properties"]), default="flags",
              show_default=True, help="--conf flags for spark-submit, JSON, or spark-defaults.conf lines.")
@click.pass_obj
def spark_conf(obj, fmt: str) -> None:
    """Print the Spark configuration for the icebarrier catalog (jars located offline)."""
    import json

    from iceberg_ext.spark import conf_as_flags, spark_conf as build

    conf = build(obj.settings())
    if fmt == "json" or obj.output == "json":
        click.echo(json.dumps(conf, indent=2, sort_keys=True))
    elif fmt == "properties":
        click.echo("\n".join(f"{k} {v}" for k, v in conf.items()))
    else:
        click.echo(conf_as_flags(conf))


@click.command("query")
@click.argument("sql")
@click.option("--level", type=click.Choice(LEVELS), default=Level.READ_COMMITTED.value, show_default=True)
@click.option("--barrier", type=int, help="Read the cut at this past barrier.")
@click.option("--limit", type=click.IntRange(1, 1_000_000), default=100, show_default=True, help="Rows to print.")
@click.pass_obj
def query(obj, sql: str, level: str, barrier: int | None, limit: int) -> None:
    """Run a Spark SQL query over a consistent cut; print the rows, the barrier and snapshots read.

    Every managed table named in full (catalog.namespace.table) reads its snapshot at the cut.
    """
    from iceberg_ext.reads import ConsistentRead
    from iceberg_ext.spark_io import referenced_tables

    conn = obj.conn()
    names = referenced_tables(sql, [v.name for v in tables.list_versions(conn)])
    if not names:
        raise IcebarrierError("the query names no managed table; name tables in full, e.g. lake.db.orders")
    spark = obj.spark()
    with ConsistentRead(conn, obj.catalog(), names, level=Level(level), barrier=barrier,
                        ttl_s=parse_duration_s("10m"), holder="icebarrier query") as reader:
        cut = reader.cut()
        frame = reader.sql(spark, sql)
        columns = frame.columns
        rows = [list(r) for r in frame.limit(limit).collect()]

    def text() -> str:
        head = f"level {cut.level.value}, barrier {barrier_label(cut.barrier)}\n"
        head += "snapshots: " + ", ".join(f"{t}={s}" for t, s in sorted(cut.snapshots.items())) + "\n"
        return head + table(columns, rows, empty="(no rows)")

    emit(obj, {"cut": cut.to_json(), "columns": columns, "rows": rows}, text)


COMMANDS = [spark_conf, query]
