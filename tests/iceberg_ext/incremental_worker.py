"""Run one SqlJob once in a process of its own (what `icebarrier run job.py --once` does).

    python -m tests.iceberg_ext.incremental_worker DSN SCHEMA WAREHOUSE JOB STATEMENT

Crash points come from ICEBARRIER_FAULT / ICEBARRIER_FAULT_AFTER (iceberg_ext.faults); a test may
also kill it with SIGKILL at any moment.
"""

from __future__ import annotations

import sys

from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.job import SqlJob
from icebarrier.iceberg_ext.runtime import Runtime


def main(dsn: str, cp_schema: str, warehouse: str, job: str, statement: str) -> None:
    settings = Settings(dsn=dsn, schema=cp_schema, warehouse=warehouse).validated()
    with Runtime(SqlJob(job, statement), settings=settings, log=lambda line: print(line, file=sys.stderr)) as rt:
        print(len(rt.run().completed), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
