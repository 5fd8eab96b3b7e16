"""``icebarrier spark-conf`` and ``query``: Spark with the icebarrier catalog."""

from __future__ import annotations

import click

from icebarrier.cli.cut import LEVELS, cut_heading, wait_for_first_cut, wait_option
from icebarrier.cli.render import BARRIER, emit, table
from icebarrier.control_plane import tables
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.model import Level, parse_duration_s
from icebarrier.iceberg_ext import spark_lines

spark_version_option = click.option(
    "--spark-version",
    metavar="X.Y",
    help=f"The Spark line the configuration is for: {' or '.join(spark_lines.LINES)} (default: the PySpark "
    f"installed here, else {spark_lines.DEFAULT.version}); Iceberg serves runtimes for these only.",
)


@click.command("spark-conf")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["flags", "json", "properties"]),
    default="flags",
    show_default=True,
    help="--conf flags for spark-submit, JSON, or spark-defaults.conf lines.",
)
@click.option("--show-secrets", is_flag=True, help="Print passwords in JSON/properties output (default: ***).")
@click.option(
    "--via",
    type=click.Choice(["jdbc", "rest"]),
    default="jdbc",
    show_default=True,
    help="The catalog Spark writes through: the SQL (JDBC) catalog in the control-plane database, or "
    "`icebarrier serve` (warehouse latest, with a job token: each commit is recorded in the same "
    "transaction as its pointer swap).",
)
@click.option("--uri", default="http://127.0.0.1:8181", show_default=True, help="With --via rest: the server.")
@click.option("--credential", help="With --via rest: a job token, CLIENT_ID:SECRET (`icebarrier token create --job`).")
@spark_version_option
@click.pass_obj
def spark_conf(
    obj, fmt: str, show_secrets: bool, via: str, uri: str, credential: str | None, spark_version: str | None
) -> None:
    """Print the Spark configuration for the icebarrier catalog (jars located offline).

    With a password in the DSN, the flags are `--properties-file FILE` (a file only you can
    read), so `spark-submit $(icebarrier spark-conf)` never shows the password in `ps`."""
    import json
    from dataclasses import replace

    from icebarrier.iceberg_ext.spark import conf_as_flags, is_secret, properties_file, redacted
    from icebarrier.iceberg_ext.spark import spark_conf as build

    line = spark_lines.wanted(spark_version)
    settings = obj.settings()
    if via == "rest":
        if not credential or credential.count(":") != 1:
            raise IcebarrierError(
                "--via rest needs --credential CLIENT_ID:SECRET (a job token from `icebarrier token create --job JOB`)"
            )
        settings = replace(
            settings,
            catalog_properties={
                "type": "rest",
                "uri": uri,
                "warehouse": "latest",
                "credential": credential,
                "oauth2-server-uri": f"{uri}/v1/oauth/tokens",
                "header.X-Iceberg-Access-Delegation": "vended-credentials",  # its tables' own storage access
            },
        )
    conf = build(settings, line)
    shown = conf if show_secrets else redacted(conf)
    if fmt == "json" or obj.output == "json":
        click.echo(json.dumps(shown, indent=2, sort_keys=True))
    elif fmt == "properties":
        click.echo("\n".join(f"{k} {v}" for k, v in shown.items()))
    elif any(is_secret(k) for k in conf):
        click.echo(f"--properties-file {properties_file(conf)}")
    else:
        click.echo(conf_as_flags(conf))


@click.command("query")
@click.argument("sql", required=False)
@click.option(
    "--file",
    "-f",
    "sql_file",
    type=click.File("r"),
    help="Read the query from this file (- for standard input) instead of SQL.",
)
@click.option("--level", type=click.Choice(LEVELS), default=Level.READ_COMMITTED.value, show_default=True)
@click.option("--barrier", type=BARRIER, help="Read the cut at this past barrier.")
@click.option("--limit", type=click.IntRange(1, 1_000_000), default=100, show_default=True, help="Rows to print.")
@wait_option
@click.pass_obj
def query(obj, sql: str | None, sql_file, level: str, barrier: int | None, limit: int, wait: str) -> None:
    """Run a Spark SQL query (SQL, or --file) over a consistent cut; print the rows, the barrier and
    snapshots read.

    Every managed table the query reads (found by Spark's parser) reads its snapshot at the cut.
    """
    if (sql is None) == (sql_file is None):
        raise click.UsageError(
            "give the query as SQL or with --file PATH, not both"
            if sql is not None
            else "missing the query: give it as SQL or with --file PATH"
        )
    if sql_file is not None:
        sql = sql_file.read()
    if not sql.strip():
        raise click.UsageError("the query is empty; give a SELECT")
    from icebarrier.iceberg_ext import spark_sql
    from icebarrier.iceberg_ext.reads import ConsistentRead

    conn = obj.conn()
    spark = obj.spark()
    names = spark_sql.check_pinnable(spark_sql.parse(spark, sql), tables.managed_names(conn))
    if not names:
        raise IcebarrierError(
            "the query reads no managed table; name one, e.g. lake.db.orders (`icebarrier table list` shows them)"
        )
    wait_for_first_cut(obj, names, Level(level), barrier, wait)
    with ConsistentRead(
        conn,
        obj.catalog(),
        names,
        level=Level(level),
        barrier=barrier,
        ttl_s=parse_duration_s("10m"),
        holder="icebarrier query",
    ) as reader:
        cut = reader.cut()
        frame = reader.sql(spark, sql)
        columns = frame.columns
        rows = [list(r) for r in frame.limit(limit).collect()]

    def text() -> str:
        head = cut_heading(cut) + "\n"
        head += "snapshots: " + ", ".join(f"{t}={s}" for t, s in sorted(cut.snapshots.items())) + "\n"
        return head + table(columns, rows, empty="(no rows)")

    emit(obj, {"cut": cut.to_json(), "columns": columns, "rows": rows}, text)


COMMANDS = [spark_conf, query]
