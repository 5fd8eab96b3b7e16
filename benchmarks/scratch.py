"""A scratch control-plane database for a benchmark run: created, migrated, dropped."""

from __future__ import annotations

import uuid
from contextlib import contextmanager

import psycopg
from psycopg import sql

from icebarrier.control_plane import schema
from icebarrier.iceberg_ext.config import Settings

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"


@contextmanager
def scratch_database(server_dsn: str):
    """Yield the DSN of a fresh, migrated database on ``server_dsn``; drop it afterwards."""
    name = f"icebarrier_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        dsn = psycopg.conninfo.make_conninfo(server_dsn, dbname=name)
        schema.upgrade(dsn)
        Settings(dsn=dsn).ensure_catalog_schema()
        yield dsn
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
