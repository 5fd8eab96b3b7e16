"""A scratch environment for the demo: a fresh database on the given Postgres (or on an
embedded one under the state directory) and a fresh warehouse (a folder under the state
directory, or a prefix under a given warehouse such as ``s3://bucket/prefix``), both removed
afterwards unless kept."""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg import sql

from icebarrier.control_plane.db import DSN_ENV


@contextmanager
def scratch(obj, purpose: str, say, *, keep: bool = False, under: str | None = None, storage=None):
    """Yield (dsn, warehouse) of a new database and warehouse for ``purpose`` (``under`` that
    warehouse, reached with ``storage``'s settings, if given)."""
    from icebarrier.apps.embedded import EmbeddedPostgres
    from icebarrier.iceberg_ext.config import state_dir
    from icebarrier.iceberg_ext.storage import Storage, remove_tree

    home = state_dir()
    server = None
    base_dsn = obj.dsn or os.environ.get(DSN_ENV)
    if not base_dsn:
        server = EmbeddedPostgres(state_dir=home / "demo-pg")
        user = server.runs_as()
        say(
            f"starting an embedded Postgres under {home / 'demo-pg'} …"
            + (
                f" (as OS user {user}: Postgres refuses to run as root; it is created if missing and removed at the end "
                f"unless --keep)"
                if user
                else ""
            )
        )
        base_dsn = server.start()
    dbname = f"icebarrier_{purpose}_{uuid.uuid4().hex[:8]}"
    warehouse = f"{under.rstrip('/')}/{dbname}" if under else Path(home / f"{purpose}-warehouse" / dbname)
    try:
        with psycopg.connect(base_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
        yield psycopg.conninfo.make_conninfo(base_dsn, dbname=dbname), warehouse
    finally:
        if not keep:
            with psycopg.connect(base_dsn, autocommit=True) as admin:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))
            if under:
                remove_tree(warehouse, (storage or Storage()).fileio())
            else:
                shutil.rmtree(warehouse, ignore_errors=True)
                try:
                    warehouse.parent.rmdir()  # when no other run's warehouse is there
                except OSError:
                    pass
            if server is not None:
                server.remove()
                say("embedded Postgres stopped and removed")
        else:
            say(
                f"kept: database {dbname} and warehouse {warehouse}"
                + (
                    f"; stop the embedded server with `pg_ctl -D {home / 'demo-pg' / 'pgdata'} stop` as its owner"
                    if server
                    else ""
                )
            )
