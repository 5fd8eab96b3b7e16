"""A transform in DuckDB SQL (its `iceberg` extension writing through the catalog, set up from
ICEBARRIER_DUCKDB_INIT): NAMESPACE.by_barrier = NAMESPACE.orders counted per barrier,
recomputed each barrier. Pause points: ``before`` (its delete staged, its insert not yet),
``after`` (both staged, before it exits)."""

import os
import sys

import duckdb
from pause_point import pause  # a sibling file, not icebarrier

namespace = sys.argv[1]
lake = os.environ["ICEBARRIER_CATALOG"]
con = duckdb.connect()
with open(os.environ["ICEBARRIER_DUCKDB_INIT"]) as init:
    con.execute(init.read())
con.execute(f"CREATE TABLE IF NOT EXISTS {lake}.{namespace}.by_barrier (barrier BIGINT, n BIGINT)")
con.execute(f"DELETE FROM {lake}.{namespace}.by_barrier")
pause("before")
con.execute(
    f"INSERT INTO {lake}.{namespace}.by_barrier "
    f"SELECT barrier, count(*) FROM {lake}.{namespace}.orders GROUP BY barrier"
)
pause("after")
