"""CPU time of processes, read from /proc (Linux)."""

from __future__ import annotations

import os
from pathlib import Path

TICK_S = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system seconds process ``pid`` has run so far (OSError once it is gone)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK_S  # utime, stime
