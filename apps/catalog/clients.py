"""How each engine reaches the consistent catalog: the configuration ``icebarrier connect``
prints, and the one ``icebarrier job exec`` hands its command.

Over https with a certificate from a CA of your own (``--ca-cert``, env ``ICEBARRIER_CA_CERT``),
each engine is told to trust it the way it can: PyIceberg's ``ssl.cabundle``, DuckDB's
``ca_cert_file``, the JVM's truststore (Spark, Trino: a PKCS12 file made from the PEM), and
``REQUESTS_CA_BUNDLE`` for the Python clients of a job's command (the CA beside the system's,
so object storage keeps its own trust). A certificate from a public CA needs none of it.
"""

from __future__ import annotations

import ssl
from pathlib import Path

ENGINES = ("spark", "pyiceberg", "duckdb", "trino")
CA_CERT_ENV = "ICEBARRIER_CA_CERT"
TRUSTSTORE_PASSWORD = "icebarrier"  # a truststore holds no secret; Java wants a password anyway


def tls_context(ca_cert: str | None) -> ssl.SSLContext:
    """The context our own clients (job exec, connect) verify the server with: the system's CAs,
    and ``ca_cert`` too when given."""
    context = ssl.create_default_context()
    if ca_cert:
        context.load_verify_locations(cafile=ca_cert)
    return context


def jvm_trust_options(truststore: str) -> str:
    """The JVM options that make ``truststore`` (PKCS12) the CAs a Java client trusts."""
    return (
        f"-Djavax.net.ssl.trustStore={truststore} -Djavax.net.ssl.trustStoreType=PKCS12 "
        f"-Djavax.net.ssl.trustStorePassword={TRUSTSTORE_PASSWORD}"
    )


def trusted_pem(ca_cert: str) -> bytes:
    """``ca_cert`` beside the public CAs (certifi's): a bundle or truststore given to a client
    replaces its own, and object storage still needs them."""
    import certifi

    return Path(ca_cert).read_bytes() + b"\n" + Path(certifi.where()).read_bytes()


def write_truststore(ca_cert: str, path: Path) -> Path:
    """:func:`trusted_pem` as a PKCS12 Java truststore at ``path``."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import BestAvailableEncryption, pkcs12

    certs = x509.load_pem_x509_certificates(trusted_pem(ca_cert))
    entries = [pkcs12.PKCS12Certificate(c, f"ca-{i}".encode()) for i, c in enumerate(certs)]
    path.write_bytes(pkcs12.serialize_java_truststore(entries, BestAvailableEncryption(TRUSTSTORE_PASSWORD.encode())))
    return path


def configuration(
    engine: str,
    warehouse: str,
    uri: str,
    credential: str,
    catalog: str,
    storage: dict[str, str] | None = None,
    *,
    ca_cert: str | None = None,
    truststore: Path | None = None,
    spark_line=None,
) -> str:
    """Client configuration; Spark's table cache is off so each query loads its tables in one
    read-committed session moment (with the cache, two tables of a query could come from loads
    made up to 30 s apart). ``storage``: the catalog's ``/v1/config`` defaults (:func:`served_storage`),
    which Trino's file system needs in its catalog file (the other engines take them from the
    catalog at run time). ``ca_cert``: the CA the server's certificate comes from, if not a
    public one (``truststore``: where it is as a Java truststore, for Spark and Trino).
    ``spark_line``: the Spark line whose Iceberg runtime Spark gets (default: the one in use here)."""
    client_id, _, secret = credential.partition(":")
    if engine == "spark":
        conf = spark_conf(warehouse, uri, credential, catalog, truststore=truststore, line=spark_line)
        return "\n".join(f"{k} {v}" for k, v in conf.items())
    if engine == "pyiceberg":
        return (
            f"# ~/.pyiceberg.yaml\ncatalog:\n  {catalog}:\n    type: rest\n    uri: {uri}\n"
            f"    warehouse: {warehouse}\n    credential: {credential}\n"
            f"    oauth2-server-uri: {uri}/v1/oauth/tokens\n"
            + (f"    ssl:\n      cabundle: {ca_cert}\n" if ca_cert else "")
        )
    if engine == "duckdb":
        return (
            f"{duckdb_install()}\n"
            + (f"SET ca_cert_file = '{ca_cert}';\n" if ca_cert else "")
            + f"CREATE SECRET icebarrier (TYPE iceberg, CLIENT_ID '{client_id}', CLIENT_SECRET '{secret}', "
            f"OAUTH2_SERVER_URI '{uri}/v1/oauth/tokens');\n"
            f"ATTACH '{warehouse}' AS {catalog} (TYPE iceberg, SECRET icebarrier, ENDPOINT '{uri}', "
            f"ACCESS_DELEGATION_MODE 'vended_credentials');"
        )
    properties = trino_properties(warehouse, uri, credential, catalog, storage or {})
    if truststore is None:
        return properties
    jvm = "".join(f"{option}\n" for option in jvm_trust_options(str(truststore)).split())
    return f"{properties}\n# etc/jvm.config (added: Trino's JVM trusts the catalog's CA)\n{jvm}"


def trino_properties(warehouse: str, uri: str, credential: str, catalog: str, storage: dict[str, str]) -> str:
    """A Trino catalog file: the Iceberg connector on the REST catalog (OAuth2 client credentials;
    vended credentials on S3), and the file system where the lake lives (Trino configures it per catalog,
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
        # Trino places a table it creates at <namespace location>/<table>-<uuid> (the server gives
        # every namespace a location), never where another table's files are
        "iceberg.unique-table-location=true",
    ]
    if storage.get(s3.REGION) or storage.get(s3.ENDPOINT):
        # S3: each table's files with the session credentials its load response vends (Trino 483
        # refuses vended credentials for a file:// location, which has none)
        lines += ["iceberg.rest-catalog.vended-credentials-enabled=true", "fs.native-s3.enabled=true"]
        lines += [f"{key}={storage[key]}" for key in (s3.ENDPOINT, s3.REGION, s3.PATH_STYLE) if storage.get(key)]
    else:
        lines.append("fs.hadoop.enabled=true")  # file:// table locations
    return "\n".join(lines) + "\n"


def served_storage(uri: str, credential: str, warehouse: str, ca_cert: str | None = None) -> dict[str, str]:
    """Where the catalog at ``uri`` says the lake's files live (its ``/v1/config`` defaults), asked
    with ``credential`` as any client would. Raises IcebarrierError naming the setting to fix."""
    import base64
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    from icebarrier.control_plane.errors import IcebarrierError

    basic = base64.b64encode(credential.encode()).decode()
    tls = tls_context(ca_cert)
    try:
        token_request = urllib.request.Request(
            f"{uri}/v1/oauth/tokens",
            data=b"grant_type=client_credentials&scope=catalog",
            headers={"Authorization": f"Basic {basic}", "Content-Type": "application/x-www-form-urlencoded"},
        )
        with urllib.request.urlopen(token_request, timeout=30, context=tls) as r:
            token = json.load(r)["access_token"]
        query = urllib.parse.urlencode({"warehouse": warehouse})
        config_request = urllib.request.Request(
            f"{uri}/v1/config?{query}", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(config_request, timeout=30, context=tls) as r:
            return json.load(r).get("defaults", {})
    except urllib.error.HTTPError as exc:
        why = exc.read().decode(errors="replace")[:200]
        if exc.code in (400, 401):
            raise IcebarrierError(
                f"the catalog at {uri} refused --credential {credential.partition(':')[0]}:… ({why}); "
                f"pass a token from `icebarrier token create --reader --namespace NS`"
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
        found = sorted(Path(spec.origin).parent.glob("extensions/*/*.duckdb_extension")) if spec and spec.origin else []
        lines.append(f"INSTALL '{found[-1]}'; LOAD {name};" if found else f"INSTALL {name}; LOAD {name};")
    return "\n".join(lines)


def spark_conf(
    warehouse: str, uri: str, credential: str, catalog: str, *, truststore: Path | None = None, line=None
) -> dict[str, str]:
    """Spark properties for catalog ``catalog`` through the REST catalog at ``uri``. Both of
    Iceberg's jars: the runtime, and the AWS bundle for tables on S3 (a client does not know where
    the lake lives; the load response says, with the storage access it needs). ``truststore``:
    the CAs the driver and executors trust (see :func:`write_truststore`)."""
    from icebarrier.iceberg_ext.spark import EXTENSIONS, add_aws_bundle, iceberg_jar

    conf = {
        "spark.jars": str(iceberg_jar(line)),
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
    if truststore is not None:
        conf["spark.driver.extraJavaOptions"] = conf["spark.executor.extraJavaOptions"] = jvm_trust_options(
            str(truststore)
        )
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
