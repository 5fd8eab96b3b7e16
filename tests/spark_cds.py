"""A class-data-sharing archive for the suite's Spark drivers: the JVM maps the classes a Spark
session loads (Spark's, Scala's, Iceberg's) from one file instead of reading, parsing and
verifying them again in every driver the suite starts. Measured here (2026-12-02, a warm Spark
4.1 session, an Iceberg create, append and aggregate): 17-20 CPU seconds a driver without it,
11-12 with it. The tests start hundreds of drivers (sessions, jobs under ``job exec``, the
checker's processes), and the suite is bound by its 2 cores.

The JVM archives only the classes of its own class path, not those of jars Spark adds at run time
(``spark.jars``): Iceberg's runtime, its AWS bundle and the JDBC driver are put on the drivers'
class path too (``SPARK_DIST_CLASSPATH``, which Spark's launcher appends; ``spark.jars`` still
names them, and the class path's copy is the one loaded). Measured here (2026-12-03, the same
workload, three runs each): 11.4-11.9 CPU seconds a driver with the jars added at run time,
9.8-10.4 with them on the class path and archived.

The archive is made once per Java, PySpark and jars (a key of the three) under
``~/.cache/icebarrier/cds/``, by one driver run with ``-XX:ArchiveClassesAtExit`` (about a minute),
under a lock. A driver whose class path differs from the archive's (another line's PySpark, a
``SPARK_CONF_DIR`` with files in it) cannot use it and runs as without it: the JVM checks, and
its CDS log lines are off so that such a fallback prints nothing.

    python -m tests.spark_cds          # make it now (the suite makes it on its first start)
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from icebarrier.iceberg_ext import config, spark_lines
from icebarrier.iceberg_ext.spark import SMALL_JOBS_JVM_OPTIONS, aws_bundle_jar, iceberg_jar, jdbc_jar

QUIET = "-Xlog:cds*=off"  # a driver that cannot use the archive falls back silently

# What the archive's driver does: what the suite's drivers do first (a session on the Iceberg
# runtime, a table created, appended to, aggregated)
WORKLOAD = """
import sys, tempfile
from pyspark.sql import SparkSession
from icebarrier.iceberg_ext.spark import EXTENSIONS
spark = (
    SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
    .config("spark.ui.showConsoleProgress", "false").config("spark.sql.shuffle.partitions", "4")
    .config("spark.jars", sys.argv[1]).config("spark.sql.extensions", EXTENSIONS)
    .config("spark.sql.catalog.b", "org.apache.iceberg.spark.SparkCatalog")
    .config("spark.sql.catalog.b.type", "hadoop").config("spark.sql.catalog.b.warehouse", tempfile.mkdtemp())
    .getOrCreate()
)
spark.sql("CREATE TABLE b.db.t (k bigint, v double) USING iceberg")
spark.range(100).selectExpr("id % 7 AS k", "CAST(id AS double) AS v").writeTo("b.db.t").append()
spark.sql("SELECT k, sum(v) FROM b.db.t GROUP BY k").collect()
spark.stop()
"""


def _java() -> str:
    java = Path(os.environ["JAVA_HOME"]) / "bin" / "java" if os.environ.get("JAVA_HOME") else "java"
    return subprocess.run([java, "-version"], capture_output=True, text=True, check=True).stderr


def class_path() -> str:
    """The jars the suite's Spark drivers add (``spark.jars``), as a class path."""
    return os.pathsep.join(str(jar) for jar in (iceberg_jar(), aws_bundle_jar(), jdbc_jar()))


def archive() -> Path:
    """The archive for the Java, PySpark and jars here, made first if it is not there."""
    import pyspark

    jars = class_path()
    key = hashlib.sha256("\n".join([_java(), pyspark.__file__, pyspark.__version__, jars]).encode()).hexdigest()
    home = config.cache_dir("cds")
    path = home / f"spark-{spark_lines.installed().version}-{key[:16]}.jsa"
    if path.is_file():
        return path
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            partial = path.with_suffix(".partial")
            partial.unlink(missing_ok=True)
            opts = f"{SMALL_JOBS_JVM_OPTIONS} -XX:ArchiveClassesAtExit={partial} {QUIET}"
            done = subprocess.run(
                [sys.executable, "-c", WORKLOAD, jars.replace(os.pathsep, ",")],
                env={**os.environ, "SPARK_SUBMIT_OPTS": opts, "SPARK_DIST_CLASSPATH": jars},
                capture_output=True,
                text=True,
            )
            if done.returncode != 0 or not partial.is_file():
                raise RuntimeError(f"the Spark drivers' class archive was not made: {done.stderr[-2000:]}")
            partial.rename(path)  # only a whole archive is ever used
            for stale in home.glob(f"spark-{spark_lines.installed().version}-*.jsa"):
                if stale != path:  # this line's archive for jars or a Java no longer here (~170 MB)
                    stale.unlink(missing_ok=True)
    return path


def driver_env() -> dict[str, str]:
    """The suite's Spark drivers' environment: the small-job JVM options and the archive, and the
    jars on the class path it was made with."""
    return {
        "SPARK_SUBMIT_OPTS": f"{SMALL_JOBS_JVM_OPTIONS} -XX:SharedArchiveFile={archive()} {QUIET}",
        "SPARK_DIST_CLASSPATH": class_path(),
    }


if __name__ == "__main__":
    print(archive(), file=sys.stderr)
