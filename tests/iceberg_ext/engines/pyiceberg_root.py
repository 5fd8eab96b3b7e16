"""A root job as a plain PyIceberg script: appends ROWS rows (id, barrier) to NAMESPACE.orders
for the barrier. Pause point: ``after`` (its commit staged, before it exits)."""

import os
import sys
import time

import pyarrow as pa
from pyiceberg.catalog import load_catalog


def pause(point: str) -> None:
    if os.environ.get("ENGINE_PAUSE") == point:
        with open(os.environ["ENGINE_PAUSE_FILE"], "w") as f:
            f.write(str(os.getpid()))
        while os.path.exists(os.environ["ENGINE_PAUSE_FILE"]):
            time.sleep(0.05)


namespace, rows = sys.argv[1], int(sys.argv[2])
barrier = int(os.environ["ICEBARRIER_BARRIER"])
catalog = load_catalog(os.environ["ICEBARRIER_CATALOG"])
schema = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("barrier", pa.int64(), nullable=False)])
orders = catalog.create_table_if_not_exists(f"{namespace}.orders", schema=schema)
pause("before")
orders.append(pa.table({"id": list(range(rows)), "barrier": [barrier] * rows}, schema=schema))
pause("after")
