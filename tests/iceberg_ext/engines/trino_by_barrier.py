"""A transform in Trino SQL, as a job under `icebarrier job exec`: NAMESPACE.by_barrier =
NAMESPACE.orders counted per barrier, recomputed each barrier.

    python trino_by_barrier.py NAMESPACE TRINO_PORT

Trino reaches the run's session through a catalog of its own, made for the run with Trino's
dynamic catalogs (``CREATE CATALOG``, the server started with ``catalog.management=dynamic``)
from exactly the properties `icebarrier connect --engine trino` prints for the run's warehouse,
and dropped at the end."""

import os
import subprocess
import sys

import trino

namespace, port = sys.argv[1], int(sys.argv[2])
catalog = "run_" + os.environ["ICEBARRIER_RUN_ID"].replace("-", "")[:16]
printed = subprocess.run(
    ["icebarrier", "connect", "--engine", "trino", "--catalog", catalog]
    + ["--uri", os.environ["ICEBARRIER_CATALOG_URI"], "--warehouse", os.environ["ICEBARRIER_CATALOG_WAREHOUSE"]]
    + ["--credential", os.environ["ICEBARRIER_CATALOG_CREDENTIAL"]],
    capture_output=True,
    text=True,
    check=True,
).stdout
properties = dict(line.split("=", 1) for line in printed.splitlines() if line and not line.startswith("#"))
connector = properties.pop("connector.name")
settings = ", ".join(f"\"{key}\" = '{value}'" for key, value in properties.items())


def run(sql: str) -> list:
    cursor = trino.dbapi.connect(host="127.0.0.1", port=port, user="job").cursor()
    cursor.execute(sql)
    return cursor.fetchall()


run(f"CREATE CATALOG {catalog} USING {connector} WITH ({settings})")
try:
    table = f"{catalog}.{namespace}.by_barrier"
    run(f"CREATE TABLE IF NOT EXISTS {table} (barrier BIGINT, n BIGINT)")
    run(f"DELETE FROM {table}")
    run(f"INSERT INTO {table} SELECT barrier, count(*) FROM {catalog}.{namespace}.orders GROUP BY barrier")
finally:
    run(f"DROP CATALOG {catalog}")
