"""A plain PyIceberg job (no icebarrier import): load NAMESPACE.TABLE, append one row, and append
the load's and the append's milliseconds to the file TIMES as a JSON line. Run by
``icebarrier job exec`` (the catalog comes from its environment) in benchmarks/maintain_beside_jobs.py."""

import json
import os
import sys
import time

import pyarrow as pa
import pyiceberg.io.pyarrow  # noqa: F401 - what the load and the append import on first use: imported
import rich.console  # noqa: F401 - here, the times below are the load's and the append's, not imports'
import rich.table  # noqa: F401 - (a profile: 97 of 104 samples of the timed load were its import)
from pyiceberg.catalog import load_catalog

table_name, times = sys.argv[1], sys.argv[2]
barrier = int(os.environ["ICEBARRIER_BARRIER"])
catalog = load_catalog(os.environ["ICEBARRIER_CATALOG"])
started = time.perf_counter()
table = catalog.load_table(table_name)
loaded = time.perf_counter()
schema = pa.schema([pa.field("n", pa.int64(), nullable=False), pa.field("at", pa.int64())])
table.append(pa.table({"n": [barrier % 1_000_000], "at": [barrier]}, schema=schema))
done = time.perf_counter()
with open(times, "a") as f:
    f.write(json.dumps({"at": time.time(), "load_ms": (loaded - started) * 1000, "append_ms": (done - loaded) * 1000}))
    f.write("\n")
