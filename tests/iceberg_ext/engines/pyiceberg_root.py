"""A root job as a plain PyIceberg script: no icebarrier import, only the environment `icebarrier
job exec` gives it. Appends ROWS rows (id, barrier) to NAMESPACE.orders for the barrier."""

import os
import sys

import pyarrow as pa
from pyiceberg.catalog import load_catalog

namespace, rows = sys.argv[1], int(sys.argv[2])
barrier = int(os.environ["ICEBARRIER_BARRIER"])
catalog = load_catalog(os.environ["ICEBARRIER_CATALOG"])
schema = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("barrier", pa.int64(), nullable=False)])
orders = catalog.create_table_if_not_exists(f"{namespace}.orders", schema=schema)
orders.append(pa.table({"id": list(range(rows)), "barrier": [barrier] * rows}, schema=schema))
