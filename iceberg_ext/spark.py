"""Spark configuration for icebarrier: the Iceberg catalog, extensions and jars.

The jars are Iceberg's own, from Maven Central at one pinned version (``spark_lines.ICEBERG_VERSION``):
the Spark runtime of the Spark line in use (:mod:`.spark_lines`: ``iceberg-spark-runtime-4.1_2.13``
or ``-3.5_2.12``) always, ``iceberg-aws-bundle`` for a warehouse on S3 (Iceberg's ``S3FileIO`` and
the AWS SDK it calls). They are fetched once into the local Maven cache and
checked against pinned SHA-256 digests (:mod:`.maven`); a Spark start never resolves from the
network once they are there. The Postgres JDBC driver is Debian's ``libpostgresql-jdbc-java`` where
installed, else ``org.postgresql:postgresql`` the same way. ``ICEBARRIER_ICEBERG_JAR``,
``ICEBARRIER_ICEBERG_AWS_JAR`` and ``ICEBARRIER_JDBC_JAR`` name local copies instead;
``ICEBARRIER_SPARK_PACKAGES`` (Maven coordinates) hands resolution to Spark's own ``--packages``.
PySpark is imported lazily; without it, Spark features say how to install it.
"""

from __future__ import annotations

import os
from pathlib import Path

from icebarrier.control_plane.errors import ConfigurationError
from icebarrier.iceberg_ext import maven, spark_lines
from icebarrier.iceberg_ext.config import Settings, state_dir
from icebarrier.iceberg_ext.spark_lines import AWS_BUNDLE, SparkLine

POSTGRES_JDBC = maven.Artifact(
    title="the Postgres JDBC driver",
    group="org.postgresql",
    artifact="postgresql",
    version="42.7.4",
    sha256="188976721ead8e8627eb6d8389d500dccc0c9bebd885268a3047180274a6031e",
    env="ICEBARRIER_JDBC_JAR",
)
PACKAGES_ENV = "ICEBARRIER_SPARK_PACKAGES"
S3_FILE_IO = "org.apache.iceberg.aws.s3.S3FileIO"
DEBIAN_JDBC_JAR = "/usr/share/java/postgresql.jar"
EXTENSIONS = "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions"
# The driver JVM's options for small runs (Spark's own SPARK_SUBMIT_OPTS; docs/declared-freshness.md,
# "Warm runners and the JVM"): the C1 compiler only and the serial collector, for a run of seconds
# much cheaper than the JVM's defaults (benchmarks/spark_jvm.py)
SMALL_JOBS_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def require_pyspark() -> SparkLine:
    """The line of the PySpark installed (raises SparkUnavailableError: none, or one Iceberg serves
    no runtime for)."""
    return spark_lines.installed()


def iceberg_jar(line: SparkLine | None = None) -> Path:
    """Iceberg's Spark runtime jar for ``line`` (default: :func:`spark_lines.wanted`; raises
    ArtifactUnavailableError)."""
    return maven.resolve((line or spark_lines.wanted()).runtime)


def aws_bundle_jar() -> Path:
    """Iceberg's AWS bundle jar (raises ArtifactUnavailableError)."""
    return maven.resolve(AWS_BUNDLE)


def jdbc_jar() -> Path:
    """The Postgres JDBC driver: ``ICEBARRIER_JDBC_JAR``, Debian's, else Maven Central's."""
    if not os.environ.get(POSTGRES_JDBC.env) and Path(DEBIAN_JDBC_JAR).is_file():
        return Path(DEBIAN_JDBC_JAR)
    return maven.resolve(POSTGRES_JDBC)


def spark_conf(settings: Settings, line: SparkLine | None = None) -> dict[str, str]:
    """Everything a SparkSession of ``line`` (default: :func:`spark_lines.wanted`) needs to use the
    icebarrier catalog."""
    cat = f"spark.sql.catalog.{settings.catalog}"
    conf = {"spark.sql.extensions": EXTENSIONS}
    packages = os.environ.get(PACKAGES_ENV)
    if packages:
        conf["spark.jars.packages"] = packages
    else:
        conf["spark.jars"] = ",".join(str(p) for p in (iceberg_jar(line), jdbc_jar()))
    if settings.on_object_storage:  # through a REST catalog too (its loads may vend the credentials)
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
    """Catalog properties for a warehouse on S3 (Iceberg's S3FileIO, which reads the same ``s3.*``
    FileIO properties as PyIceberg; the region is its ``client.region``). The jar: :func:`add_aws_bundle`."""
    from icebarrier.iceberg_ext import storage

    conf = {f"{cat}.io-impl": S3_FILE_IO}
    for key, value in settings.storage.fileio().items():
        conf[f"{cat}.{storage.JAVA_REGION if key == storage.REGION else key}"] = value
    return conf


def add_aws_bundle(conf: dict[str, str]) -> None:
    """Add the AWS bundle S3FileIO needs to ``conf``'s jars (or to its packages, where
    ``ICEBARRIER_SPARK_PACKAGES`` hands resolution to Spark)."""
    if "spark.jars.packages" in conf and not os.environ.get(AWS_BUNDLE.env):
        conf["spark.jars.packages"] += f",{AWS_BUNDLE.coordinates}"
    else:
        conf["spark.jars"] = ",".join(filter(None, [conf.get("spark.jars"), str(aws_bundle_jar())]))


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


def spark_session(
    settings: Settings, *, app_name: str = "icebarrier", master: str | None = None, extra=None, kafka: bool = False
):
    """A SparkSession configured for icebarrier (reuses an active one with the same catalog);
    ``kafka``: with Spark's Kafka source on its class path (a new session only)."""
    line = require_pyspark()
    from pyspark.sql import SparkSession

    settings.require_catalog_schema()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # local mode: no guessing at interfaces
    builder = SparkSession.builder.appName(app_name)
    master = master or os.environ.get("ICEBARRIER_SPARK_MASTER", "local[2]")
    builder = builder.master(master)
    wanted = spark_conf(settings, line)
    if kafka:
        jars = [str(maven.resolve(a)) for a in line.kafka]
        wanted["spark.jars"] = ",".join(filter(None, [wanted.get("spark.jars"), *jars]))
    wanted = {**wanted, **(extra or {})}
    if master.startswith("local"):
        wanted = _jars_not_on_class_path(wanted)
    for key, value in wanted.items():
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
    spark = builder.getOrCreate()
    for key in (f"spark.sql.catalog.{settings.catalog}", f"spark.sql.catalog.{settings.catalog}.uri"):
        if key in wanted and spark.conf.get(key, None) != wanted[key]:
            raise ConfigurationError(
                f"the running SparkSession has {key}={spark.conf.get(key, None)}, not {wanted[key]}; "
                f"stop it first or start it with `icebarrier spark-conf`"
            )
    return spark


def _jars_not_on_class_path(conf: dict[str, str]) -> dict[str, str]:
    """``conf`` without the ``spark.jars`` that Spark's launcher puts on the driver's class path
    already (``SPARK_DIST_CLASSPATH``), for a local master, whose executor is the driver's JVM:
    Spark copies each jar of ``spark.jars`` into every session's own folder through its file
    server (118 MB a session for Iceberg's runtime and AWS bundle; 1.1-1.6 CPU-s of a session
    that creates, appends to and aggregates a table, measured on 2026-12-03)."""
    on_path = {os.path.realpath(p) for p in os.environ.get("SPARK_DIST_CLASSPATH", "").split(os.pathsep) if p}
    jars = [j for j in conf.get("spark.jars", "").split(",") if j and os.path.realpath(j) not in on_path]
    trimmed = {k: v for k, v in conf.items() if k != "spark.jars"}
    return {**trimmed, "spark.jars": ",".join(jars)} if jars else trimmed


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
