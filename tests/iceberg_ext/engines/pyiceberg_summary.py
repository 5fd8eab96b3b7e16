"""A transform as a plain PyIceberg script with two sinks: NAMESPACE.summary and NAMESPACE.audit
each get one row (n, last): the rows counted in NAMESPACE.by_barrier and its newest barrier,
overwritten each barrier. Pause points: ``before`` (summary staged, audit not yet), ``after``
(both staged, before it exits). With a third argument, a table to read or write that the job
did not declare (``read:NS.T`` or ``write:NS.T``)."""

import os
import sys

import pyarrow as pa
import pyarrow.compute as pc
from pause_point import pause  # a sibling file, not icebarrier
from pyiceberg.catalog import load_catalog

namespace = sys.argv[1]
catalog = load_catalog(os.environ["ICEBARRIER_CATALOG"])
counts = catalog.load_table(f"{namespace}.by_barrier").scan().to_arrow()
schema = pa.schema([pa.field("n", pa.int64(), nullable=False), pa.field("last", pa.int64(), nullable=True)])
row = pa.table({"n": [pc.sum(counts["n"]).as_py() or 0], "last": [pc.max(counts["barrier"]).as_py()]}, schema=schema)
if len(sys.argv) > 2:
    how, table = sys.argv[2].split(":", 1)
    if how == "read":
        catalog.load_table(table).scan().to_arrow()
    else:
        catalog.create_table_if_not_exists(table, schema=schema).append(row)
for i, sink in enumerate(("summary", "audit")):
    catalog.create_table_if_not_exists(f"{namespace}.{sink}", schema=schema).overwrite(row)
    if i == 0:
        pause("before")
pause("after")
