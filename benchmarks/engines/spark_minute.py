"""A plain PySpark batch job of about a minute on 2 cores (the `job exec` overhead benchmark):
hashes ROWS ids, aggregates them into 100,000 groups, and appends the result to TABLE of the
catalog its environment configures."""

import os
import sys

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

table, rows = sys.argv[1], int(sys.argv[2])
lake = os.environ["ICEBARRIER_CATALOG"]
spark = SparkSession.builder.master("local[2]").appName("spark_minute").getOrCreate()
spark.sql(f"CREATE TABLE IF NOT EXISTS {lake}.{table} (k BIGINT, n BIGINT, s DOUBLE) USING iceberg")
hashed = spark.range(rows).select(
    (F.col("id") % 100_000).alias("k"), F.sha2(F.col("id").cast("string"), 256).alias("h")
)
hashed.groupBy("k").agg(
    F.count("*").alias("n"), F.sum(F.conv(F.substring("h", 1, 8), 16, 10).cast("double")).alias("s")
).writeTo(f"{lake}.{table}").append()
spark.stop()
