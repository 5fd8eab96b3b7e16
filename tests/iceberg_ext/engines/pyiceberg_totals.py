"""A transform as a plain PyIceberg script: NAMESPACE.totals = one row (rows, max barrier) of
NAMESPACE.orders, overwritten each barrier."""

import os
import sys

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import load_catalog

namespace = sys.argv[1]
catalog = load_catalog(os.environ["ICEBARRIER_CATALOG"])
orders = catalog.load_table(f"{namespace}.orders").scan().to_arrow()
schema = pa.schema([pa.field("n", pa.int64(), nullable=False), pa.field("last", pa.int64(), nullable=True)])
totals = catalog.create_table_if_not_exists(f"{namespace}.totals", schema=schema)
totals.overwrite(pa.table({"n": [orders.num_rows], "last": [pc.max(orders["barrier"]).as_py()]}, schema=schema))
