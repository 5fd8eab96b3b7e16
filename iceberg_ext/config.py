"""One configuration source: flags, then environment variables, then ``icebarrier.toml``.

By default the Iceberg catalog is a JDBC/SQL catalog in the same Postgres as the control
plane, in its own schema (``icebarrier_catalog``), shared by Spark (``type=jdbc``) and
PyIceberg (``SqlCatalog``) under one catalog name (default ``lake``), with a local
warehouse directory. Other PyIceberg catalogs (REST, Hive, Glue) are configuration:
``[catalog_properties]`` in the TOML file are passed through to both engines. Where the files
live is a separate setting (``[storage]``, :mod:`.storage`): FileIO settings added to whichever
catalog is in use.

``icebarrier.toml`` (looked up in ``$ICEBARRIER_CONFIG``, else ./icebarrier.toml)::

    dsn = "postgresql://postgres@127.0.0.1:5432/postgres"
    schema = "icebarrier"
    catalog = "lake"
    warehouse = "file:///data/warehouse"      # or s3://bucket/prefix
    [storage]                                  # FileIO settings (object storage): see storage.py
    "s3.endpoint" = "http://127.0.0.1:9000"
    [catalog_properties]                       # optional, for non-default catalogs
    type = "rest"
    uri = "http://rest-catalog:8181"
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import quote

import psycopg

from icebarrier.control_plane import db
from icebarrier.control_plane.db import DEFAULT_SCHEMA, resolve_dsn
from icebarrier.control_plane.errors import ConfigurationError
from icebarrier.control_plane.model import parse_schema_name
from icebarrier.iceberg_ext import storage
from icebarrier.iceberg_ext.storage import Storage

CONFIG_ENV = "ICEBARRIER_CONFIG"
HOME_ENV = "ICEBARRIER_HOME"
SECTIONS = ("catalog_properties", "storage")
ENV = {
    "dsn": "ICEBARRIER_DSN",
    "schema": "ICEBARRIER_SCHEMA",
    "catalog": "ICEBARRIER_CATALOG",
    "catalog_schema": "ICEBARRIER_CATALOG_SCHEMA",
    "warehouse": "ICEBARRIER_WAREHOUSE",
}


def _config_file(config_file: str | Path | None) -> dict:
    """The TOML file's values (``--config``, ``$ICEBARRIER_CONFIG`` or ./icebarrier.toml if present)."""
    named = config_file or os.environ.get(CONFIG_ENV)
    if named and not Path(named).is_file():
        raise ConfigurationError(
            f"config file {named} does not exist; fix --config / {CONFIG_ENV}, or leave it "
            f"out to use ./icebarrier.toml when present"
        )
    path = Path(named or "icebarrier.toml")
    if not path.is_file():
        return {}
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"config file {path} is not valid TOML ({exc}); fix or remove it") from None
    unknown = set(values) - {*ENV, *SECTIONS}
    if unknown:
        raise ConfigurationError(
            f"config file {path} has unknown keys {sorted(unknown)}; known: {sorted([*ENV, *SECTIONS])}"
        )
    return values


def state_dir() -> Path:
    return Path(os.environ.get(HOME_ENV, Path.home() / ".icebarrier"))


def cache_dir(*parts: str) -> Path:
    """Where a component fetched or built once is cached: ``$XDG_CACHE_HOME/icebarrier/<parts>``."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "icebarrier", *parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    dsn: str
    schema: str = DEFAULT_SCHEMA
    catalog: str = "lake"
    catalog_schema: str = "icebarrier_catalog"
    warehouse: str = ""
    catalog_properties: dict[str, str] = field(default_factory=dict)
    storage: Storage = field(default_factory=Storage)

    @classmethod
    def load(cls, config_file: str | Path | None = None, **flags: str | None) -> Settings:
        """Flags win over environment variables, which win over the TOML file."""
        values = _config_file(config_file)
        for key, env in ENV.items():
            if os.environ.get(env):
                values[key] = os.environ[env]
            if flags.get(key) is not None:  # a flag given empty is an error, not the default
                values[key] = flags[key]
        values["storage"] = Storage.from_config(values.get("storage"))
        values["dsn"] = resolve_dsn(values.get("dsn"))
        settings = cls(**{k: v for k, v in values.items() if v is not None})
        return settings.validated()

    @staticmethod
    def load_catalog_name(config_file: str | Path | None = None) -> str:
        """The catalog's name alone (``ICEBARRIER_CATALOG``, then the file), for a client that has
        no DSN: `icebarrier connect`."""
        return os.environ.get(ENV["catalog"]) or _config_file(config_file).get("catalog") or "lake"

    @staticmethod
    def load_storage(config_file: str | Path | None = None) -> Storage:
        """The storage settings alone (for a program that brings its own database: demo, check)."""
        return Storage.from_config(_config_file(config_file).get("storage"))

    def validated(self) -> Settings:
        parse_schema_name(self.schema)
        parse_schema_name(self.catalog_schema)
        if not self.catalog.isidentifier():
            raise ConfigurationError(f"catalog name {self.catalog!r} is invalid; use an identifier such as lake")
        warehouse = self.warehouse or (state_dir() / "warehouse").as_uri()
        if "://" not in warehouse:
            warehouse = Path(warehouse).resolve().as_uri()
        storage.validate_warehouse(warehouse)
        return replace(self, warehouse=warehouse)

    # -- derived connection strings ------------------------------------------------------------

    @property
    def _conninfo(self) -> dict:
        info = psycopg.conninfo.conninfo_to_dict(self.dsn)
        return {
            "hosts": db.hosts_of(info),
            "dbname": info.get("dbname") or info.get("user") or "postgres",
            "user": info.get("user") or "postgres",
            "password": info.get("password"),
            "target_session_attrs": info.get("target_session_attrs"),
        }

    @property
    def is_default_catalog(self) -> bool:
        return not self.catalog_properties

    @property
    def sqlalchemy_uri(self) -> str:
        """The SQL catalog for PyIceberg: the control-plane database, catalog schema first. Several
        hosts go as SQLAlchemy's ``host=`` query parameters, with the DSN's ``target_session_attrs``."""
        c = self._conninfo
        auth = quote(c["user"], safe="") + (f":{quote(c['password'], safe='')}" if c["password"] else "")
        query = f"options={quote(f'-csearch_path={self.catalog_schema}', safe='')}"
        if len(c["hosts"]) == 1:
            host, port = c["hosts"][0]
            where = f"{host}:{port}"
        else:
            where = ""
            query += "".join(f"&host={h}:{p}" for h, p in c["hosts"])
            query += f"&target_session_attrs={c['target_session_attrs']}"
        return f"postgresql+psycopg://{auth}@{where}/{quote(c['dbname'], safe='')}?{query}"

    @property
    def jdbc_uri(self) -> str:
        """The same catalog for Spark's JdbcCatalog (several hosts: the driver's ``targetServerType=primary``)."""
        c = self._conninfo
        hosts = ",".join(f"{h}:{p}" for h, p in c["hosts"])
        primary = "&targetServerType=primary" if len(c["hosts"]) > 1 else ""
        return f"jdbc:postgresql://{hosts}/{c['dbname']}?currentSchema={self.catalog_schema}{primary}"

    @property
    def jdbc_user(self) -> str:
        return self._conninfo["user"]

    @property
    def jdbc_password(self) -> str | None:
        return self._conninfo["password"]

    @property
    def on_object_storage(self) -> bool:
        return storage.is_object_storage(self.warehouse)

    def pyiceberg_properties(self) -> dict[str, str]:
        """The catalog's properties plus the FileIO settings (added, never replacing them)."""
        if not self.is_default_catalog:
            return {"warehouse": self.warehouse, **self.catalog_properties, **self.storage.fileio()}
        return {
            "type": "sql",
            "uri": self.sqlalchemy_uri,
            "warehouse": self.warehouse,
            "schema_version": "v1",
            "pool_pre_ping": "true",
            **self.storage.fileio(),
        }

    def check_storage(self) -> None:
        """A wrong bucket, endpoint or key as one line naming the setting (the default catalog's
        warehouse on object storage; another catalog says where its tables are itself)."""
        if self.is_default_catalog:
            storage.check(self.warehouse, self.storage.fileio())

    def require_catalog_schema(self) -> None:
        """The default SQL catalog's schema must exist (``icebarrier db upgrade`` creates it);
        nothing is created here, so a command refused later has written nothing."""
        if not self.is_default_catalog:
            return
        with db.connect(self.dsn, self.schema, check_schema=False) as conn:  # its one-line refusals
            found = db.one(conn.execute("SELECT to_regnamespace(%s) IS NOT NULL AS found", (self.catalog_schema,)))
        if not found["found"]:
            raise ConfigurationError(
                f"the Iceberg catalog schema {self.catalog_schema!r} does not exist in the control-plane database; "
                f"run `icebarrier db upgrade` first"
            )

    def ensure_catalog_schema(self) -> None:
        """The default SQL catalog lives in its own Postgres schema; create it if missing."""
        if not self.is_default_catalog:
            return
        with db.connect(self.dsn, self.schema, check_schema=False) as conn:
            conn.execute(
                psycopg.sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(psycopg.sql.Identifier(self.catalog_schema))
            )
        if self.warehouse:
            storage.make_local(self.warehouse)
