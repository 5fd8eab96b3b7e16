"""The Spark lines icebarrier runs on, and the jars each needs (DESIGN.md, "The engines users run
today").

Iceberg serves a Spark runtime per Spark line and Scala version; its newest release (1.12.0) serves
Spark 4.1 (Scala 2.13) and 3.5 (Scala 2.12) only. icebarrier supports exactly those two. The line is
the installed PySpark's (``pyspark.__version__``); ``spark-conf --spark-version`` names another for
a cluster elsewhere. Every jar is pinned by version and SHA-256 and fetched once from Maven Central
(:mod:`.maven`). The extras ``spark41`` and ``spark35`` install a line's PySpark; ``spark`` is
:data:`DEFAULT`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from icebarrier.iceberg_ext import maven
from icebarrier.iceberg_ext.errors import SparkUnavailableError

ICEBERG_VERSION = "1.12.0"


@dataclass(frozen=True, slots=True, kw_only=True)
class SparkLine:
    """One Spark line (``4.1``): its Scala version, the PySpark a user installs for it, and the
    jars icebarrier adds to it."""

    version: str
    scala: str
    install: str  # what a user runs to get it
    runtime: maven.Artifact  # Iceberg's Spark runtime for this line
    kafka: tuple[maven.Artifact, ...]  # Spark's Kafka source and what it needs beyond PySpark's jars

    def __str__(self) -> str:
        return f"Spark {self.version}"


def _jar(title: str, coordinates: str, sha256: str, env: str) -> maven.Artifact:
    group, artifact, version = coordinates.split(":")
    return maven.Artifact(title=title, group=group, artifact=artifact, version=version, sha256=sha256, env=env)


def _runtime(line: str, scala: str, sha256: str) -> maven.Artifact:
    return _jar(
        "Iceberg's Spark runtime jar",
        f"org.apache.iceberg:iceberg-spark-runtime-{line}_{scala}:{ICEBERG_VERSION}",
        sha256,
        "ICEBARRIER_ICEBERG_JAR",
    )


def _kafka(*jars: tuple[str, str]) -> tuple[maven.Artifact, ...]:
    return tuple(
        _jar(f"Spark's Kafka connector ({c.split(':')[1]})", c, sha256, f"ICEBARRIER_SPARK_KAFKA_{i}_JAR")
        for i, (c, sha256) in enumerate(jars)
    )


LINES = {
    "4.1": SparkLine(
        version="4.1",
        scala="2.13",
        install="pip install 'icebarrier[spark41]'",
        runtime=_runtime("4.1", "2.13", "3123c3798af642dd537230923548e013ef41cc28b6626e5225808cf5670a0f82"),
        # 4.1.3's connector; its token provider at 4.1.1, the newest 4.1 one Maven Central serves
        # (a patch release of the same line); kafka-clients and commons-pool2 as its pom names them
        kafka=_kafka(
            (
                "org.apache.spark:spark-sql-kafka-0-10_2.13:4.1.3",
                "cb31ffd9c8f5527dba061db8af671d295562092e4f3f5ff42fc249fab8a8fde6",
            ),
            (
                "org.apache.spark:spark-token-provider-kafka-0-10_2.13:4.1.1",
                "e510adc37b03d01d0a190d0dab472b5538e05eaa77454f7e9477156d7a6820ae",
            ),
            (
                "org.apache.kafka:kafka-clients:3.9.1",
                "7568b998572d256f0b7bc0afdc1b7a2588b8b08415c62ce314c864a6851ae9d9",
            ),
            (
                "org.apache.commons:commons-pool2:2.12.1",
                "5273c8bc8c0dca2211175c0d27efbd7228efae99689aac001a8e1ef8e872e9ef",
            ),
        ),
    ),
    "3.5": SparkLine(
        version="3.5",
        scala="2.12",
        install="pip install 'icebarrier[spark35]'",
        runtime=_runtime("3.5", "2.12", "8dd8c90e54ed1a20f2461309d047a255ee56382eb7c0a46162b27a4936fd86dc"),
        # 3.5.7 is the newest 3.5 connector Maven Central serves here; the 3.5 line keeps its
        # source API, so it runs on PySpark 3.5.9
        kafka=_kafka(
            (
                "org.apache.spark:spark-sql-kafka-0-10_2.12:3.5.7",
                "184f8bd4a3cd22299c49090d88b894f81fd7546b4ee64879519a0d76a685dbb8",
            ),
            (
                "org.apache.spark:spark-token-provider-kafka-0-10_2.12:3.5.7",
                "9701914db5c6d09628b58d2d2c1ccd2c9ea28f32f83dd6cb21f98b8237531ff4",
            ),
            (
                "org.apache.kafka:kafka-clients:3.4.1",
                "9d0a9058c8ede79db6e54ae378ed16fe8d1bead2894635a4aa6aa0b7981668c6",
            ),
            (
                "org.apache.commons:commons-pool2:2.11.1",
                "ea0505ee7515e58b1ac0e686e4d1a5d9f7d808e251a61bc371aa0595b9963f83",
            ),
        ),
    ),
}
DEFAULT = LINES["4.1"]  # what the `spark` extra installs
AWS_BUNDLE = _jar(
    "Iceberg's AWS bundle jar (S3FileIO, for a warehouse on S3)",
    f"org.apache.iceberg:iceberg-aws-bundle:{ICEBERG_VERSION}",
    "dd7e49ffa4ac9b215bed846581991259e3aec9bb2fa08d6cec029c46cd66d957",
    "ICEBARRIER_ICEBERG_AWS_JAR",
)


def line_of(spark_version: str) -> SparkLine:
    """The supported line a Spark version (``4.1.3``, ``3.5``) belongs to.

    Raises :class:`SparkUnavailableError` naming the supported lines and how to install one."""
    line = LINES.get(".".join(spark_version.strip().split(".")[:2]))
    if line is None:
        raise SparkUnavailableError(unsupported(spark_version))
    return line


def unsupported(spark_version: str) -> str:
    """The one line that says a Spark version is not served, and what is."""
    supported = " or ".join(f"Spark {v} ({line.install})" for v, line in LINES.items())
    return (
        f"Spark {spark_version} has no Iceberg {ICEBERG_VERSION} runtime; icebarrier runs on {supported}; "
        f"install one of them"
    )


def installed() -> SparkLine:
    """The line of the PySpark this process runs with.

    Raises :class:`SparkUnavailableError` when PySpark is missing or of a line Iceberg serves no
    runtime for."""
    try:
        import pyspark
    except ImportError:
        raise SparkUnavailableError("this needs PySpark; pip install 'icebarrier[spark]'") from None
    return line_of(pyspark.__version__)


def wanted(spark_version: str | None = None) -> SparkLine:
    """The line to configure: ``spark_version``'s if given (a cluster elsewhere), else the installed
    PySpark's, else :data:`DEFAULT` (no PySpark here: the configuration is for another machine)."""
    if spark_version is not None:
        return line_of(spark_version)
    try:
        import pyspark
    except ImportError:
        return DEFAULT
    return line_of(pyspark.__version__)
