"""The ``icebarrier`` command: a click group with global --dsn, --schema, --output, --debug.

Commands parse, call one library function, render. Library errors become one line on
stderr and exit 1; bad usage exits 2 (click); tracebacks only with --debug.
"""

from __future__ import annotations

import sys

import click
import psycopg

from icebarrier.cli.render import one_line
from icebarrier.control_plane.errors import IcebarrierError


class Context:
    """Per-invocation state: settings and a lazily opened control-plane connection."""

    def __init__(self, dsn: str | None, schema: str | None, config: str | None, output: str, debug: bool) -> None:
        self.dsn, self.schema, self.config, self.output, self.debug = dsn, schema, config, output, debug
        self._conn: psycopg.Connection | None = None
        self._settings = None
        self._catalog = None

    def settings(self):
        """Flags, then environment, then icebarrier.toml (see iceberg_ext.config)."""
        if self._settings is None:
            from icebarrier.iceberg_ext.config import Settings

            self._settings = Settings.load(self.config, dsn=self.dsn, schema=self.schema)
        return self._settings

    def conn(self) -> psycopg.Connection:
        if self._conn is None:
            from icebarrier.control_plane.db import connect

            settings = self.settings()
            self._conn = connect(settings.dsn, settings.schema, actor=f"cli:{_os_user()}")
        return self._conn

    def catalog(self):
        if self._catalog is None:
            from icebarrier.iceberg_ext.catalog import load_catalog

            self._catalog = load_catalog(self.settings())
        return self._catalog

    def spark(self, app_name: str = "icebarrier-cli"):
        from icebarrier.iceberg_ext.spark import spark_session

        return spark_session(self.settings(), app_name=app_name)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _os_user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


class IcebarrierGroup(click.Group):
    """Maps library errors to a one-line message and exit 1, bad usage to one line and exit 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx else "icebarrier"
            click.echo(f"error: {one_line(exc.format_message())} (see `{where} --help`)", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"error: {one_line(exc.format_message())}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(1)
        if isinstance(code, int) and code:
            sys.exit(code)
        return code

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except IcebarrierError as exc:
            if _debug(ctx):
                raise
            click.echo(f"error: {one_line(str(exc))}", err=True)
            sys.exit(1)
        except psycopg.Error as exc:
            if _debug(ctx):
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            click.echo(
                f"error: control-plane database error: {one_line(first)} (rerun with --debug for details)", err=True
            )
            sys.exit(1)


def _debug(ctx: click.Context) -> bool:
    obj = ctx.find_object(Context)
    return bool(obj and obj.debug)


@click.group(cls=IcebarrierGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--dsn", envvar="ICEBARRIER_DSN", help="Control-plane Postgres DSN (env ICEBARRIER_DSN).")
@click.option("--schema", envvar="ICEBARRIER_SCHEMA", help="Postgres schema of the control plane (default icebarrier).")
@click.option(
    "--output",
    "-o",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Text for people, JSON (stable, documented in the README) for scripts.",
)
@click.option(
    "--config",
    envvar="ICEBARRIER_CONFIG",
    type=click.Path(dir_okay=False),
    help="icebarrier.toml with dsn, schema, catalog, warehouse (default ./icebarrier.toml).",
)
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="icebarrier")
@click.pass_context
def cli(ctx: click.Context, dsn: str | None, schema: str | None, config: str | None, output: str, debug: bool) -> None:
    """icebarrier: consistent reads across a pipeline of Iceberg tables.

    Barriers cut the pipeline's input; jobs complete them in order; readers get a
    consistent snapshot per table at a consistency level. See `icebarrier COMMAND --help`.
    """
    obj = Context(dsn, schema, config, output, debug)
    ctx.obj = obj
    ctx.call_on_close(obj.close)


def _register_commands() -> None:
    from icebarrier.cli import (
        audit,
        barrier,
        catalog,
        check,
        cut,
        db,
        delay,
        demo,
        doctor,
        inputs,
        job,
        lease,
        maintenance,
        namespace,
        postgres,
        run,
        schedule,
        spark,
        table,
    )

    for module in (
        db,
        job,
        barrier,
        inputs,
        table,
        cut,
        lease,
        delay,
        spark,
        maintenance,
        run,
        schedule,
        demo,
        check,
        catalog,
        namespace,
        postgres,
        audit,
        doctor,
    ):
        for command in module.COMMANDS:
            cli.add_command(command)


_register_commands()


def main() -> None:
    cli(prog_name="icebarrier")


if __name__ == "__main__":
    main()
