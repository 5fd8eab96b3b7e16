"""Spark configuration for icebarrier: the Iceberg catalog, extensions and jars, offline.

Jars are found without Maven: the Iceberg runtime from the ``snowpark-connect-deps-iceberg``
wheel (1.0.2; 1.0.3's jar lacks shaded Jackson), the Postgres JDBC driver from Debian's
``libpostgresql-jdbc-java`` (or the ``wbjdbc`` wheel). Override with
``ICEBARRIER_ICEBERG_JAR`` / ``ICEBARRIER_JDBC_JAR`` (paths), or
``ICEBARRIER_SPARK_PACKAGES`` (Maven coordinates, where Maven is reachable).
PySpark is imported lazily; without it, Spark features say how to install it.

A warehouse on S3 needs Iceberg's ``S3FileIO`` and the AWS SDK it calls: the
``iceberg-aws-bundle`` jar of the runtime's Iceberg version. No package on PyPI or Debian ships
it, so it is ``ICEBARRIER_ICEBERG_AWS_JAR`` (a path) when set, else its Maven coordinates in
``spark.jars.packages`` (Spark fetches it where Maven Central is reachable).
"""

from __future__ import annotations

import glob
import os
import zipfile
from pathlib import Path

from icebarrier.control_plane.errors import ConfigurationError, IcebarrierError
from icebarrier.iceberg_ext.config import Settings, state_dir

ICEBERG_JAR_NAME = "iceberg-spark-runtime-3.5_2.12-1.10.2.jar"
ICEBERG_JAR_ENV = "ICEBARRIER_ICEBERG_JAR"
JDBC_JAR_ENV = "ICEBARRIER_JDBC_JAR"
PACKAGES_ENV = "ICEBARRIER_SPARK_PACKAGES"
AWS_JAR_ENV = "ICEBARRIER_ICEBERG_AWS_JAR"
ICEBERG_VERSION = "1.10.2"  # the runtime jar's (ICEBERG_JAR_NAME)
AWS_BUNDLE = f"org.apache.iceberg:iceberg-aws-bundle:{ICEBERG_VERSION}"
S3_FILE_IO = "org.apache.iceberg.aws.s3.S3FileIO"
DEBIAN_JDBC_JAR = "/usr/share/java/postgresql.jar"
SHADED_JACKSON = "org/apache/iceberg/shaded/com/fasterxml/jackson/databind/ObjectMapper.class"
EXTENSIONS = "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions"
# The driver JVM's options for small runs (Spark's own SPARK_SUBMIT_OPTS; docs/declared-freshness.md,
# "Warm runners and the JVM"): the C1 compiler only and the serial collector, for a run of seconds
# much cheaper than the JVM's defaults (benchmarks/spark_jvm.py)
SMALL_JOBS_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


class SparkUnavailableError(IcebarrierError):
    """PySpark or a jar Spark needs is missing."""


def require_pyspark():
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise SparkUnavailableError(
            "this needs PySpark; pip install 'icebarrier[spark]' (pyspark 3.5 and the Iceberg jar)"
        ) from None
    return pyspark


def iceberg_jar() -> Path:
    override = os.environ.get(ICEBERG_JAR_ENV)
    if override:
        path = Path(override)
    else:
        try:
            import snowpark_connect_deps_iceberg as deps
        except ImportError:
            raise SparkUnavailableError(
                f"no Iceberg Spark runtime jar; pip install 'icebarrier[spark]' "
                f"(snowpark-connect-deps-iceberg==1.0.2) or set {ICEBERG_JAR_ENV} to the jar's path"
            ) from None
        path = Path(deps.get_jars_dir()) / ICEBERG_JAR_NAME
    if not path.is_file():
        raise SparkUnavailableError(f"Iceberg runtime jar {path} does not exist; fix {ICEBERG_JAR_ENV} or reinstall")
    with zipfile.ZipFile(path) as jar:
        if SHADED_JACKSON not in jar.namelist():
            raise SparkUnavailableError(
                f"Iceberg runtime jar {path} lacks shaded Jackson and fails on the first CREATE TABLE; "
                f"pip install 'snowpark-connect-deps-iceberg==1.0.2' (not 1.0.3) or set {ICEBERG_JAR_ENV}"
            )
    return path


def jdbc_jar() -> Path:
    override = os.environ.get(JDBC_JAR_ENV)
    candidates = [override] if override else [DEBIAN_JDBC_JAR, *_wheel_jdbc_jars()]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise SparkUnavailableError(
        f"no Postgres JDBC driver jar{f' at {override}' if override else ''}; "
        f"apt-get install libpostgresql-jdbc-java, pip install wbjdbc, or set {JDBC_JAR_ENV}"
    )


def _wheel_jdbc_jars() -> list[str]:
    import importlib.util

    spec = importlib.util.find_spec("wbjdbc")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = next(iter(spec.submodule_search_locations))
    return sorted(glob.glob(f"{root}/**/postgresql-*.jar", recursive=True))


def spark_conf(settings: Settings) -> dict[str, str]:
    """Everything a SparkSession needs to use the icebarrier catalog."""
    cat = f"spark.sql.catalog.{settings.catalog}"
    conf = {"spark.sql.extensions": EXTENSIONS}
    packages = os.environ.get(PACKAGES_ENV)
    if packages:
        conf["spark.jars.packages"] = packages
    else:
        conf["spark.jars"] = ",".join(str(p) for p in (iceberg_jar(), jdbc_jar()))
    if settings.on_object_storage and settings.is_default_catalog:
        conf.update(s3_catalog_conf(settings, cat))
        add_aws_bundle(conf)
    conf[cat] = "org.apache.iceberg.spark.SparkCatalog"
    conf[f"{cat}.cache-enabled"] = "false"  # a cut must never read stale cached metadata
    conf[f"{cat}.warehouse"] = settings.warehouse
    if settings.is_default_catalog:
        conf[f"{cat}.type"] = "jdbc"
        conf[f"{cat}.uri"] = settings.jdbc_uri
        conf[f"{cat}.jdbc.user"] = settings.jdbc_user
        if settings.jdbc_password:
            conf[f"{cat}.jdbc.password"] = settings.jdbc_password
        conf[f"{cat}.jdbc.schema-version"] = "V1"
    else:
        for key, value in settings.catalog_properties.items():
            conf[f"{cat}.{key}"] = str(value)
    return conf


def s3_catalog_conf(settings: Settings, cat: str) -> dict[str, str]:
    """Catalog properties and the jar for a warehouse on S3 (Iceberg's S3FileIO, which reads the
    same ``s3.*`` FileIO properties as PyIceberg; the region is its ``client.region``)."""
    from icebarrier.iceberg_ext import storage

    conf = {f"{cat}.io-impl": S3_FILE_IO}
    for key, value in settings.storage.fileio().items():
        conf[f"{cat}.{'client.region' if key == storage.REGION else key}"] = value
    return conf


def add_aws_bundle(conf: dict[str, str]) -> None:
    """Add the AWS bundle S3FileIO needs to ``conf``'s jars: ``ICEBARRIER_ICEBERG_AWS_JAR``, else
    its Maven coordinates (see the module docstring)."""
    jar = os.environ.get(AWS_JAR_ENV)
    if jar and not Path(jar).is_file():
        raise SparkUnavailableError(
            f"{AWS_JAR_ENV}={jar} does not exist; point it at "
            f"iceberg-aws-bundle-{ICEBERG_VERSION}.jar ({AWS_BUNDLE} on Maven Central)"
        )
    if jar:
        conf["spark.jars"] = ",".join(filter(None, [conf.get("spark.jars"), jar]))
    else:
        conf["spark.jars.packages"] = ",".join(filter(None, [conf.get("spark.jars.packages"), AWS_BUNDLE]))


# Spark's log configuration where the user has none: errors only, on stderr (Spark's default
# prints WARN lines and a banner on every start, before any setLogLevel can run).
SPARK_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = stderr
appender.console.type = Console
appender.console.name = stderr
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.repl.name = org.apache.spark.repl.Main
logger.repl.level = error
logger.pyspark.name = org.apache.spark.api.python.PythonGatewayServer
logger.pyspark.level = error
"""


DRIVER_HOST_ENV = "ICEBARRIER_SPARK_DRIVER_HOST"


def quiet_log_config() -> Path:
    """A log4j2 file with :data:`SPARK_LOG4J2` (written once under the state directory)."""
    path = state_dir() / "spark-log4j2.properties"
    if not path.is_file() or path.read_text() != SPARK_LOG4J2:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(SPARK_LOG4J2)
        tmp.replace(path)
    return path


def spark_session(settings: Settings, *, app_name: str = "icebarrier", master: str | None = None, extra=None):
    """A SparkSession configured for icebarrier (reuses an active one with the same catalog)."""
    require_pyspark()
    from pyspark.sql import SparkSession

    settings.require_catalog_schema()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # local mode: no guessing at interfaces
    builder = SparkSession.builder.appName(app_name)
    builder = builder.master(master or os.environ.get("ICEBARRIER_SPARK_MASTER", "local[2]"))
    wanted = spark_conf(settings)
    for key, value in {**wanted, **(extra or {})}.items():
        builder = builder.config(key, value)
    if "spark.driver.extraJavaOptions" not in (extra or {}):  # quiet from the JVM's first line, no progress bars
        builder = builder.config(
            "spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{quiet_log_config()}"
        )
    builder = builder.config("spark.ui.showConsoleProgress", "false")
    if os.environ.get(DRIVER_HOST_ENV):  # executors elsewhere (containers, other hosts) connect back here
        builder = builder.config("spark.driver.host", os.environ[DRIVER_HOST_ENV])
        builder = builder.config("spark.driver.bindAddress", "0.0.0.0")
    builder = builder.config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4")
    builder = builder.config("spark.sql.session.timeZone", "UTC")
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # noqa: BLE001 - Spark says why in pages of JVM output
        if settings.on_object_storage and AWS_BUNDLE in wanted.get("spark.jars.packages", ""):
            raise SparkUnavailableError(
                f"Spark could not start with {AWS_BUNDLE} for the S3 warehouse (it fetches it from Maven Central); "
                f"download iceberg-aws-bundle-{ICEBERG_VERSION}.jar and set {AWS_JAR_ENV} to its path"
            ) from exc
        raise
    for key in (f"spark.sql.catalog.{settings.catalog}", f"spark.sql.catalog.{settings.catalog}.uri"):
        if key in wanted and spark.conf.get(key, None) != wanted[key]:
            raise ConfigurationError(
                f"the running SparkSession has {key}={spark.conf.get(key, None)}, not {wanted[key]}; "
                f"stop it first or start it with `icebarrier spark-conf`"
            )
    return spark


def conf_as_flags(conf: dict[str, str]) -> str:
    import shlex

    return " ".join(f"--conf {shlex.quote(f'{k}={v}')}" for k, v in conf.items())


def is_secret(key: str) -> bool:
    return key.endswith((".password", ".credential", ".token", ".secret", ".secret-access-key", ".session-token"))


def redacted(conf: dict[str, str]) -> dict[str, str]:
    """The conf with secrets shown as ``***`` (for printing)."""
    return {k: ("***" if is_secret(k) else v) for k, v in conf.items()}


def properties_file(conf: dict[str, str]) -> Path:
    """Write the conf to a spark-submit properties file only its owner can read (mode 0600),
    so a password never appears on a command line (where `ps` shows it)."""
    import hashlib

    text = "".join(f"{k} {v}\n" for k, v in conf.items())
    path = state_dir() / f"spark-{hashlib.sha256(text.encode()).hexdigest()[:12]}.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return path
