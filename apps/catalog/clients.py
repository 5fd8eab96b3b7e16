"""How each engine reaches the consistent catalog: the configuration ``icebarrier connect``
prints, and the one ``icebarrier job exec`` hands its command."""

from __future__ import annotations

ENGINES = ("spark", "pyiceberg", "duckdb", "trino")


def configuration(
    engine: str, warehouse: str, uri: str, credential: str, catalog: str, storage: dict[str, str] | None = None
) -> str:
    """Client configuration; Spark's table cache is off so each query loads its tables in one
    read-committed session moment (with the cache, two tables of a query could come from loads
    made up to 30 s apart). ``storage``: the catalog's ``/v1/config`` defaults (:func:`served_storage`),
    which Trino's file system needs in its catalog file (the other engines take them from the
    catalog at run time)."""
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
    return trino_properties(warehouse, uri, credential, catalog, storage or {})


def trino_properties(warehouse: str, uri: str, credential: str, catalog: str, storage: dict[str, str]) -> str:
    """A Trino catalog file: the Iceberg connector on the REST catalog (OAuth2 client credentials,
    vended credentials), and the file system where the lake lives (Trino configures it per catalog,
    not per table): S3's endpoint, region and path style from the catalog, else the local disk."""
    from icebarrier.iceberg_ext import storage as s3

    lines = [
        f"# etc/catalog/{catalog}.properties",
        "connector.name=iceberg",
        "iceberg.catalog.type=rest",
        f"iceberg.rest-catalog.uri={uri}",
        f"iceberg.rest-catalog.warehouse={warehouse}",
        "iceberg.rest-catalog.security=OAUTH2",
        f"iceberg.rest-catalog.oauth2.credential={credential}",
        f"iceberg.rest-catalog.oauth2.server-uri={uri}/v1/oauth/tokens",
        "iceberg.rest-catalog.vended-credentials-enabled=true",
        # Trino places a table it creates at <namespace location>/<table>-<uuid> (the server gives
        # every namespace a location), never where another table's files are
        "iceberg.unique-table-location=true",
    ]
    if storage.get(s3.REGION) or storage.get(s3.ENDPOINT):
        lines.append("fs.native-s3.enabled=true")
        lines += [f"{key}={storage[key]}" for key in (s3.ENDPOINT, s3.REGION, s3.PATH_STYLE) if storage.get(key)]
    else:
        lines.append("fs.hadoop.enabled=true")  # file:// table locations
    return "\n".join(lines) + "\n"


def served_storage(uri: str, credential: str, warehouse: str) -> dict[str, str]:
    """Where the catalog at ``uri`` says the lake's files live (its ``/v1/config`` defaults), asked
    with ``credential`` as any client would. Raises IcebarrierError naming the setting to fix."""
    import base64
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    from icebarrier.control_plane.errors import IcebarrierError

    basic = base64.b64encode(credential.encode()).decode()
    try:
        token_request = urllib.request.Request(
            f"{uri}/v1/oauth/tokens",
            data=b"grant_type=client_credentials&scope=catalog",
            headers={"Authorization": f"Basic {basic}", "Content-Type": "application/x-www-form-urlencoded"},
        )
        with urllib.request.urlopen(token_request, timeout=30) as r:
            token = json.load(r)["access_token"]
        query = urllib.parse.urlencode({"warehouse": warehouse})
        config_request = urllib.request.Request(
            f"{uri}/v1/config?{query}", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(config_request, timeout=30) as r:
            return json.load(r).get("defaults", {})
    except urllib.error.HTTPError as exc:
        why = exc.read().decode(errors="replace")[:200]
        if exc.code in (400, 401):
            raise IcebarrierError(
                f"the catalog at {uri} refused --credential {credential.partition(':')[0]}:… ({why}); "
                f"pass a token from `icebarrier token create --reader`"
            ) from None
        raise IcebarrierError(f"the catalog at {uri} answered {exc.code} ({why}); check --uri") from None
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        raise IcebarrierError(
            f"cannot reach the catalog at --uri {uri} ({getattr(exc, 'reason', exc)}); start `icebarrier serve` "
            f"there or pass the right --uri"
        ) from None


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
