"""A root job as a plain PyIceberg script: appends ROWS rows (id, barrier) to NAMESPACE.orders
for the barrier. Pause points: ``before`` (its table created, nothing appended), ``after`` (its
commit staged, before it exits)."""

import os
import sys

import pyarrow as pa
from pause_point import pause  # a sibling file, not icebarrier
from pyiceberg.catalog import load_catalog

namespace, rows = sys.argv[1], int(sys.argv[2])
barrier = int(os.environ["ICEBARRIER_BARRIER"])
catalog = load_catalog(os.environ["ICEBARRIER_CATALOG"])
schema = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("barrier", pa.int64(), nullable=False)])
orders = catalog.create_table_if_not_exists(f"{namespace}.orders", schema=schema)
pause("before")
orders.append(pa.table({"id": list(range(rows)), "barrier": [barrier] * rows}, schema=schema))
pause("after")
