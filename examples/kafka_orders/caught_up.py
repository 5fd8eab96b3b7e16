"""Wait until the pipeline's read-committed cut covers everything produced so far: issue a barrier
and wait (at most TIMEOUT seconds, default 120) until every table of the pipeline completed it.

    python3 caught_up.py [TIMEOUT]          # prints the barrier and how long it took
"""

import sys
import time

from pipeline import tables

from icebarrier.control_plane import barriers, db, reads
from icebarrier.control_plane.errors import NoValidCutError
from icebarrier.control_plane.model import TableName, barrier_label
from icebarrier.iceberg_ext.config import Settings

settings = Settings.load()
timeout = float(sys.argv[1]) if len(sys.argv) > 1 else 120.0
with db.connect(settings.dsn, settings.schema) as conn:
    time.sleep(0.5)  # the broker's clock past the last record
    barrier = barriers.issue(conn).barrier
    names = [TableName.parse(t) for t in tables("kshop", settings.catalog).values()]
    started = time.monotonic()
    while True:
        try:
            if reads.resolve(conn, names).barrier >= barrier:
                break
        except NoValidCutError:  # no consistent cut yet: the jobs are starting
            pass
        if time.monotonic() - started > timeout:
            sys.exit(f"the pipeline did not reach barrier {barrier_label(barrier)} in {timeout:g} s")
        time.sleep(0.2)
print(f"read-committed at {barrier_label(barrier)} after {time.monotonic() - started:.1f} s")
