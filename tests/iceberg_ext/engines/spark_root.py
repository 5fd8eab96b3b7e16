"""A root job in plain PySpark (the configuration comes from SPARK_CONF_DIR): appends ROWS rows
(id, barrier) to NAMESPACE.orders for the barrier. Pause points: ``before`` (inside the write:
tasks running, nothing committed), ``after`` (its commit staged, before it exits)."""

import os
import sys
import time

from pyspark.sql import SparkSession
from pyspark.sql.functions import udf


def pause(point: str, pid: int) -> None:
    if os.environ.get("ENGINE_PAUSE") == point:
        with open(os.environ["ENGINE_PAUSE_FILE"], "w") as f:
            f.write(str(pid))
        while os.path.exists(os.environ["ENGINE_PAUSE_FILE"]):
            time.sleep(0.05)


namespace, rows = sys.argv[1], int(sys.argv[2])
lake, barrier = os.environ["ICEBARRIER_CATALOG"], int(os.environ["ICEBARRIER_BARRIER"])
driver = os.getpid()
spark = SparkSession.builder.master("local[1]").appName("spark_root").getOrCreate()
spark.sql(
    f"CREATE TABLE IF NOT EXISTS {lake}.{namespace}.orders (id BIGINT NOT NULL, barrier BIGINT NOT NULL) USING iceberg"
)


@udf("bigint")
def tagged(i):
    if i == 0:
        pause("before", driver)
    return barrier


spark.range(rows).select("id", tagged("id").alias("barrier")).writeTo(f"{lake}.{namespace}.orders").append()
pause("after", driver)
spark.stop()
