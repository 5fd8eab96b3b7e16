"""The script the checker's `icebarrier job exec` jobs run: plain PyIceberg through the catalog
configuration job exec puts in the environment (no icebarrier API; the model's pure functions).

    python -m icebarrier.apps.check.exec_script root|derived NAMESPACE SEED BARRIERS_FILE

The root appends the model's events of the session's barrier range (``ICEBARRIER_FROM_BARRIER``,
``ICEBARRIER_BARRIER``; barrier numbers from the file the driver appends as it issues them);
the intermediate derives its sink from its source as the session serves it (at ``S(T, B)``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _number(barriers_file: Path, barrier: int, timeout_s: float = 60) -> int:
    """The barrier's number in the run (the driver appends each as it issues it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if barriers_file.exists():
            for line in barriers_file.read_text().splitlines():
                record = json.loads(line)
                if record["barrier"] == barrier:
                    return record["number"]
        if time.monotonic() > deadline:
            raise SystemExit(f"barrier {barrier} is not in {barriers_file}")
        time.sleep(0.05)


def _script(kind: str, namespace: str, seed: int, barriers_file: Path) -> None:
    from pyiceberg.catalog import load_catalog

    from icebarrier.apps.check.model import DERIVED, ROOTS, WINDOW, derive, events

    catalog = load_catalog(os.environ["ICEBARRIER_CATALOG"])
    barrier = int(os.environ["ICEBARRIER_BARRIER"])
    previous = os.environ.get("ICEBARRIER_FROM_BARRIER")
    if kind == "root":
        table = ROOTS["orders_in"]
        t_from = _number(barriers_file, int(previous)) * WINDOW if previous else 0
        rows = events(seed, table, t_from, _number(barriers_file, barrier) * WINDOW)
        if rows.num_rows:  # nothing arrived: commit nothing (the barrier completes unchanged)
            catalog.load_table(f"{namespace}.{table}").append(rows)
        return
    sources, sink = DERIVED["balances_job"]
    data = {s: catalog.load_table(f"{namespace}.{s}").scan().to_arrow() for s in sources}
    catalog.load_table(f"{namespace}.{sink}").overwrite(derive(sink, data))


if __name__ == "__main__":
    _script(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
