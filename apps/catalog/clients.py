"""How each engine reaches the consistent catalog: the configuration ``icebarrier connect``
prints, and the one ``icebarrier job exec`` hands its command."""

from __future__ import annotations

ENGINES = ("spark", "pyiceberg", "duckdb", "trino")


def configuration(engine: str, warehouse: str, uri: str, credential: str, catalog: str) -> str:
    """Client configuration; Spark's table cache is off so each query loads its tables in one
    read-committed session moment (with the cache, two tables of a query could come from loads
    made up to 30 s apart)."""
    client_id, _, secret = credential.partition(":")
    if engine == "spark":
        return "\n".join(f"{k} {v}" for k, v in spark_conf(warehouse, uri, credential, catalog).items())
    if engine == "pyiceberg":
        return (
            f"# ~/.pyiceberg.yaml\ncatalog:\n  {catalog}:\n    type: rest\n    uri: {uri}\n"
            f"    warehouse: {warehouse}\n    credential: {credential}\n"
            f"    oauth2-server-uri: {uri}/v1/oauth/tokens\n"
        )
    if engine == "duckdb":
        return (
            f"{duckdb_install()}\n"
            f"CREATE SECRET icebarrier (TYPE iceberg, CLIENT_ID '{client_id}', CLIENT_SECRET '{secret}', "
            f"OAUTH2_SERVER_URI '{uri}/v1/oauth/tokens');\n"
            f"ATTACH '{warehouse}' AS {catalog} (TYPE iceberg, SECRET icebarrier, ENDPOINT '{uri}', "
            f"ACCESS_DELEGATION_MODE 'vended_credentials');"
        )
    return (
        f"# etc/catalog/{catalog}.properties\nconnector.name=iceberg\niceberg.catalog.type=rest\n"
        f"iceberg.rest-catalog.uri={uri}\niceberg.rest-catalog.warehouse={warehouse}\n"
        f"iceberg.rest-catalog.security=OAUTH2\niceberg.rest-catalog.oauth2.credential={credential}\n"
        f"iceberg.rest-catalog.oauth2.server-uri={uri}/v1/oauth/tokens\n"
        f"iceberg.rest-catalog.vended-credentials-enabled=true\n"
    )


def duckdb_install() -> str:
    """DuckDB statements that load the iceberg extension: from the extension wheels when they
    are installed (``pip install duckdb-extension-iceberg``…, offline), else from DuckDB's
    repository. The catalog hands it the storage access each table needs
    (``ACCESS_DELEGATION_MODE 'vended_credentials'``: see :mod:`.delegation`)."""
    import importlib.util
    from pathlib import Path

    lines = []
    for name in ("avro", "httpfs", "iceberg"):  # iceberg needs the other two
        spec = importlib.util.find_spec(f"duckdb_extension_{name}")
        found = sorted(Path(spec.origin).parent.glob("extensions/*/*.duckdb_extension")) if spec else []
        lines.append(f"INSTALL '{found[-1]}'; LOAD {name};" if found else f"INSTALL {name}; LOAD {name};")
    return "\n".join(lines)


def spark_conf(warehouse: str, uri: str, credential: str, catalog: str) -> dict[str, str]:
    """Spark properties for catalog ``catalog`` through the REST catalog at ``uri``. Both of
    Iceberg's jars: the runtime, and the AWS bundle for tables on S3 (a client does not know where
    the lake lives; the load response says, with the storage access it needs)."""
    from icebarrier.iceberg_ext.spark import EXTENSIONS, add_aws_bundle, iceberg_jar

    conf = {
        "spark.jars": str(iceberg_jar()),
        "spark.sql.extensions": EXTENSIONS,
        f"spark.sql.catalog.{catalog}": "org.apache.iceberg.spark.SparkCatalog",
        f"spark.sql.catalog.{catalog}.type": "rest",
        f"spark.sql.catalog.{catalog}.uri": uri,
        f"spark.sql.catalog.{catalog}.warehouse": warehouse,
        f"spark.sql.catalog.{catalog}.rest.auth.type": "oauth2",
        f"spark.sql.catalog.{catalog}.credential": credential,
        f"spark.sql.catalog.{catalog}.oauth2-server-uri": f"{uri}/v1/oauth/tokens",
        f"spark.sql.catalog.{catalog}.cache-enabled": "false",
        # the storage access a table needs comes with its load
        f"spark.sql.catalog.{catalog}.header.X-Iceberg-Access-Delegation": "vended-credentials",
    }
    add_aws_bundle(conf)
    return conf


def pyiceberg_environment(warehouse: str, uri: str, credential: str, catalog: str) -> dict[str, str]:
    """PyIceberg's configuration of catalog ``catalog`` as environment variables
    (``PYICEBERG_CATALOG__<NAME>__<PROPERTY>``, ``_`` standing for ``-``)."""
    prefix = f"PYICEBERG_CATALOG__{catalog.upper()}__"
    return {
        f"{prefix}TYPE": "rest",
        f"{prefix}URI": uri,
        f"{prefix}WAREHOUSE": warehouse,
        f"{prefix}CREDENTIAL": credential,
        f"{prefix}OAUTH2_SERVER_URI": f"{uri}/v1/oauth/tokens",
    }
