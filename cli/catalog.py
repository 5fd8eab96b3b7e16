"""``icebarrier serve``, ``connect`` and ``token``: the consistent catalog for every engine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from icebarrier.apps.catalog.clients import CA_CERT_ENV, ENGINES, configuration
from icebarrier.cli.render import emit, table
from icebarrier.cli.spark import spark_version_option
from icebarrier.control_plane import job_sessions, tables, tokens
from icebarrier.control_plane.errors import InvalidNameError, InvalidValueError
from icebarrier.control_plane.model import (
    TableName,
    check_namespace,
    parse_duration_s,
    parse_size_bytes,
    quote_name,
    split_name,
    sql_levels,
)


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (other hosts: 0.0.0.0).")
@click.option("--port", type=click.IntRange(1, 65535), default=8181, show_default=True)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Server processes; one more accepts each connection and hands it to the one holding fewest (a dead "
    "one is replaced). All state is in Postgres.",
)
@click.option(
    "--session-quiet",
    default="1s",
    show_default=True,
    help="A read-committed session moves to the newest cut after this long without loads.",
)
@click.option("--allow-anonymous-read", is_flag=True, help="Serve clients without a token (read-only).")
@click.option(
    "--allowed-location",
    "allowed_locations",
    multiple=True,
    metavar="PREFIX",
    help="Another prefix table locations may lie under (repeatable); the warehouse always is one.",
)
@click.option(
    "--max-body",
    default="8MB",
    show_default=True,
    help="The largest request body (the OAuth2 token request: 64 KB); a larger one is refused with 413 "
    "before it is read.",
)
@click.option(
    "--max-body-memory",
    default="64MB",
    show_default=True,
    help="Request bodies held in memory at once, all requests together (per server process); a body "
    "that would pass it is answered 503 with Retry-After.",
)
@click.option(
    "--body-timeout",
    default="30s",
    show_default=True,
    help="A request body must arrive within this long (a client sending a byte a second gets 408).",
)
@click.option(
    "--max-per-token",
    type=click.IntRange(1, 100_000),
    default=32,
    show_default=True,
    help="Requests in flight per token (per address without one); one more is answered 429 with Retry-After.",
)
@click.option(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False),
    help="Serve https with this certificate chain (PEM); with --tls-key.",
)
@click.option("--tls-key", type=click.Path(exists=True, dir_okay=False), help="The certificate's private key (PEM).")
@click.option(
    "--shutdown-grace",
    default="10s",
    show_default=True,
    help="On SIGTERM: stop accepting, let requests in flight finish this long, then close the rest.",
)
@click.option(
    "--heartbeat",
    default="20s",
    show_default=True,
    help="A long poll (`job exec --follow`) with nothing to say sends a line this often, under the idle "
    "timeout of any proxy in front (1s to 60s). Each line costs the server about 0.1 ms: longer saves CPU "
    "where no proxy cuts idle connections sooner.",
)
@click.option(
    "--token-ttl",
    default="1h",
    show_default=True,
    help="How long an access token lives (1m to 24h); clients take a new one with their credentials. "
    "`job exec` takes it before a long poll that would outlive the one it holds.",
)
@click.option(
    "--scan-planning",
    type=click.Choice(["client", "server"]),
    default="client",
    show_default=True,
    help="Where clients plan scans by default: server tells every client (scan-planning-mode in /v1/config "
    "and in each load) to plan on this server, at the warehouse's cut. A client may ask for it either way.",
)
@click.option(
    "--plan-submit-above",
    type=click.IntRange(1, 1_000_000),
    default=512,
    show_default=True,
    help="A scan plan over more data manifests than this is answered submitted at once; the client "
    "fetches its result (any server process makes it) or cancels it.",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one line per request (request id, principal, route, status, duration; never a secret).",
)
@click.pass_obj
def serve(
    obj,
    host: str,
    port: int,
    workers: int,
    session_quiet: str,
    allow_anonymous_read: bool,
    allowed_locations: tuple[str, ...],
    max_body: str,
    max_body_memory: str,
    body_timeout: str,
    max_per_token: int,
    tls_cert: str | None,
    tls_key: str | None,
    shutdown_grace: str,
    heartbeat: str,
    token_ttl: str,
    scan_planning: str,
    plan_submit_above: int,
    log_format: str,
) -> None:
    """Serve the lake over the Iceberg REST catalog protocol, with consistent warehouses:
    latest, read-committed, read-committed:<namespace>, barrier-<B>, lease-<ID>.

    The server keeps its state in Postgres: scale out with --workers, or run several behind
    one address. Table locations are confined to the warehouse (and --allowed-location
    prefixes) and never overlap another table's. /healthz and /readyz answer without a token
    (for load balancers and probes)."""
    quiet_ms = max(1, round(parse_duration_s(session_quiet) * 1000))
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together: give both to serve https, or neither")
    running: dict = {"ssl_certfile": tls_cert, "ssl_keyfile": tls_key} if tls_cert else {}
    running["timeout_graceful_shutdown"] = max(1, round(parse_duration_s(shutdown_grace)))
    heartbeat_s = parse_duration_s(heartbeat)
    if not 1 <= heartbeat_s <= job_sessions.MAX_HEARTBEAT_S:
        raise click.UsageError(
            f"--heartbeat {heartbeat} is outside 1s..{job_sessions.MAX_HEARTBEAT_S:.0f}s (a client stops "
            f"waiting for a line after longer); use e.g. --heartbeat 20s"
        )
    token_ttl_s = parse_duration_s(token_ttl)
    if not tokens.MIN_SESSION_TTL_S <= token_ttl_s <= tokens.MAX_SESSION_TTL_S:
        raise click.UsageError(f"--token-ttl {token_ttl} is outside 1m..24h; use e.g. --token-ttl 1h")

    import uvicorn

    from icebarrier.apps.catalog import server
    from icebarrier.apps.catalog import workers as workers_module

    options = {
        "quiet_ms": quiet_ms,
        "allow_anonymous_read": allow_anonymous_read,
        "allowed_locations": list(allowed_locations),
        "max_body_bytes": parse_size_bytes(max_body),
        "max_body_memory": parse_size_bytes(max_body_memory),
        "body_timeout_s": parse_duration_s(body_timeout),
        "max_per_token": max_per_token,
        "log_format": log_format,
        "heartbeat_s": heartbeat_s,
        "token_ttl_s": round(token_ttl_s),
        "scan_planning": scan_planning,
        "plan_submit_above": plan_submit_above,
    }
    settings = obj.settings()
    if workers == 1:
        uvicorn.run(
            server.process_app(settings, **options),
            host=host,
            port=port,
            log_level="warning",
            http=server.HTTP_PROTOCOL,
            **running,
        )
        return
    server.check_settings(settings)  # one line now, not one per worker
    os.environ[server.WORKER_ENV] = json.dumps({"config": obj.config, "dsn": obj.dsn, "schema": obj.schema, **options})
    config = uvicorn.Config(
        f"{server.__name__}:{server.worker_app.__name__}",
        factory=True,
        host=host,
        port=port,
        log_level="warning",
        http=server.HTTP_PROTOCOL,
        **running,
    )
    workers_module.serve(config, workers)


@click.command("connect")
@click.option("--engine", type=click.Choice(ENGINES), required=True)
@click.option(
    "--warehouse",
    default="read-committed",
    show_default=True,
    help="latest, read-committed, read-committed:<namespace>, barrier-<B>, lease-<ID>, or job / "
    "job:<JOB> (a job's session, see `icebarrier job exec`).",
)
@click.option("--uri", default="http://127.0.0.1:8181", show_default=True, help="Where `icebarrier serve` listens.")
@click.option(
    "--credential", default="CLIENT_ID:SECRET", show_default=True, help="A token from `icebarrier token create`."
)
@click.option(
    "--catalog",
    help="The catalog's name in the engine (Trino: the properties file's name); default: the configured "
    "catalog (ICEBARRIER_CATALOG, icebarrier.toml), else lake.",
)
@click.option(
    "--ca-cert",
    type=click.Path(exists=True, dir_okay=False),
    envvar=CA_CERT_ENV,
    help="The CA (PEM) of the server's certificate, for https with a CA of your own; for Spark and "
    "Trino it is written beside it as a Java truststore (.p12) [env ICEBARRIER_CA_CERT].",
)
@spark_version_option
@click.pass_obj
def connect(
    obj,
    engine: str,
    warehouse: str,
    uri: str,
    credential: str,
    catalog: str | None,
    ca_cert: str | None,
    spark_version: str | None,
) -> None:
    """Print a ready-to-paste configuration for ENGINE to read (or write) through the catalog.

    Needs only the server's URI and a token (no DSN). For Trino it asks the server where the
    lake's files live (S3's endpoint and region go in the catalog file), so the token must be real."""
    from icebarrier.apps.catalog.clients import served_storage, write_truststore
    from icebarrier.apps.catalog.warehouses import Warehouse
    from icebarrier.control_plane.errors import ConfigurationError
    from icebarrier.iceberg_ext import spark_lines
    from icebarrier.iceberg_ext.config import Settings

    line = spark_lines.wanted(spark_version) if engine == "spark" else None
    catalog = catalog or Settings.load_catalog_name(obj.config)
    if not catalog.isidentifier():
        raise ConfigurationError(f"catalog name {catalog!r} is invalid; use an identifier such as lake")
    parsed, uri = str(Warehouse.parse(warehouse)), uri.rstrip("/")
    ca_cert = str(Path(ca_cert).resolve()) if ca_cert else None
    storage = served_storage(uri, credential, parsed, ca_cert) if engine == "trino" else None
    truststore = None
    if ca_cert and engine in ("spark", "trino"):
        truststore = write_truststore(ca_cert, Path(ca_cert).with_suffix(".p12"))
    text = configuration(
        engine, parsed, uri, credential, catalog, storage, ca_cert=ca_cert, truststore=truststore, spark_line=line
    )
    emit(obj, {"engine": engine, "warehouse": parsed, "configuration": text}, text)


def _grant_options(command):
    command = click.option(
        "--write", is_flag=True, help="A job's token may also write the unmanaged tables granted (and create them)."
    )(command)
    command = click.option(
        "--table",
        "table_names",
        multiple=True,
        metavar="TABLE",
        help="Grant this table, CATALOG.NS.TABLE (repeatable).",
    )(command)
    return click.option(
        "--namespace",
        "namespaces",
        multiple=True,
        metavar="NS",
        help="Grant this namespace's tables and those of the namespaces under it (repeatable).",
    )(command)


def parse_namespace(text: str) -> tuple[str, ...]:
    """A namespace as written (``a.b``: two levels; ```a.b```: one)."""
    levels = split_name(text.strip())
    if levels is None:
        raise InvalidNameError(
            f"namespace {text!r} is invalid; write its levels joined by '.', each letters, digits and underscores "
            f"or quoted in backticks (`a.b` is one level)"
        )
    return check_namespace(levels)


def _grants(obj, namespaces, table_names, write: bool) -> list[tokens.Grant]:
    """The grants named, each checked to exist (a namespace in the catalog; a table in the catalog
    or declared by a job)."""
    privilege = "write" if write else "read"
    catalog = obj.catalog() if namespaces or table_names else None
    given = []
    for text in namespaces:
        namespace = parse_namespace(text)
        if not catalog.namespace_exists(sql_levels(namespace)):
            raise InvalidValueError(
                f"namespace {quote_name(namespace)} does not exist in the catalog; check --namespace, or create it "
                f"with `icebarrier namespace create {quote_name(namespace)}`"
            )
        given.append(tokens.Grant("namespace", quote_name(namespace), privilege))
    for text in table_names:
        name = TableName.parse(text)
        if not catalog.table_exists(name.identifier) and not tables.is_managed(obj.conn(), name):
            raise InvalidValueError(f"table {name} does not exist in the catalog nor as a job's sink; check --table")
        given.append(tokens.Grant("table", str(name), privilege))
    return given


@click.group("token")
def token_group() -> None:
    """Credentials for catalog clients: a reader, one job (it may commit to its sinks), or an
    admin (it may run any job's session)."""


@token_group.command("create")
@click.option("--reader", is_flag=True, help="A token that reads only.")
@click.option("--job", help="A token that acts for JOB: commits to its sinks through warehouse latest.")
@click.option(
    "--admin",
    is_flag=True,
    help="A token that runs any job's session (warehouse job:<JOB>, `icebarrier job exec`), e.g. for a scheduler.",
)
@click.option("--name", help="What the token is for (shown in token list).")
@click.option(
    "--whole-lake",
    is_flag=True,
    help="It reaches every table: reads all (a job's token also writes every unmanaged table). Without it, a "
    "reader reaches what it is granted, a job its sources, sinks and grants.",
)
@_grant_options
@click.pass_obj
def create(
    obj, reader: bool, job: str | None, admin: bool, name: str | None, whole_lake: bool, namespaces, table_names, write
) -> None:
    """Create a token; prints CLIENT_ID:SECRET once (only a hash of the secret is kept)."""
    if reader + (job is not None) + admin != 1:
        raise click.UsageError("pass exactly one of --reader, --job JOB or --admin")
    given = _grants(obj, namespaces, table_names, write)  # checked before anything is written
    if admin and (whole_lake or given):
        raise click.UsageError("an admin token reaches the whole lake: drop --whole-lake, --namespace and --table")
    if whole_lake and given:
        raise click.UsageError("--whole-lake reaches every table: drop --namespace and --table, or --whole-lake")
    if reader and not (whole_lake or given):
        raise click.UsageError(
            "a reader token reaches only what it is granted: add --namespace NS and/or --table TABLE, or --whole-lake"
        )
    conn = obj.conn()
    with conn.transaction():
        client_id, secret = tokens.create(conn, job=job, name=name, admin=admin, whole_lake=whole_lake)
        if given:
            tokens.grant(conn, client_id, given)
    role = "admin" if admin else "job" if job else "reader"
    emit(
        obj,
        {"client_id": client_id, "client_secret": secret, "role": role, "job": job, "grants": [str(g) for g in given]},
        f"{client_id}:{secret}",
    )


@token_group.command("grant")
@click.argument("client_id")
@_grant_options
@click.pass_obj
def grant(obj, client_id: str, namespaces, table_names, write: bool) -> None:
    """Let a token read (--write: a job's token also write, where no job's sink is) the tables of
    a namespace (and the namespaces under it) or a table. Servers apply it at once."""
    given = _grants(obj, namespaces, table_names, write)
    if not given:
        raise click.UsageError("name what to grant: --namespace NS and/or --table CATALOG.NS.TABLE")
    t = tokens.grant(obj.conn(), client_id, given)
    emit(obj, t.to_json(), f"token {t.client_id} reaches: {', '.join(t.grants)}")


@token_group.command("ungrant")
@click.argument("client_id")
@click.option("--namespace", "namespaces", multiple=True, metavar="NS", help="A namespace granted (repeatable).")
@click.option("--table", "table_names", multiple=True, metavar="TABLE", help="A table granted (repeatable).")
@click.pass_obj
def ungrant(obj, client_id: str, namespaces, table_names) -> None:
    """Take grants back from a token; servers apply it at once."""
    taken = [tokens.Grant("namespace", quote_name(parse_namespace(n)), "read") for n in namespaces]
    taken += [tokens.Grant("table", str(TableName.parse(t)), "read") for t in table_names]
    if not taken:
        raise click.UsageError("name what to take back: --namespace NS and/or --table CATALOG.NS.TABLE")
    t = tokens.ungrant(obj.conn(), client_id, taken)
    emit(obj, t.to_json(), f"token {t.client_id} reaches: {', '.join(t.grants) or 'nothing granted'}")


@token_group.command("list")
@click.pass_obj
def list_(obj) -> None:
    """List tokens (never their secrets)."""
    found = tokens.list_tokens(obj.conn())
    emit(
        obj,
        [t.to_json() for t in found],
        lambda: table(
            ["client id", "role", "job", "name", "reaches", "created", "revoked"],
            [
                (
                    t.client_id,
                    t.kind,
                    t.job,
                    t.name,
                    _reach(t),
                    t.created_at.isoformat(timespec="seconds"),
                    t.revoked_at.isoformat(timespec="seconds") if t.revoked_at else None,
                )
                for t in found
            ],
        ),
    )


def _reach(t: tokens.Token) -> str:
    if t.whole_lake:
        return "the whole lake"
    own = ["its sources and sinks"] if t.job else []
    return "\n".join(own + t.grants) or "nothing"


@token_group.command("revoke")
@click.argument("client_id")
@click.pass_obj
def revoke(obj, client_id: str) -> None:
    """Revoke a token; its sessions end at once on every server."""
    t = tokens.revoke(obj.conn(), client_id)
    emit(obj, t.to_json(), f"revoked token {t.client_id}")


COMMANDS = [serve, connect, token_group]
