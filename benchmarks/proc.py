"""Processes: a benchmark's run in a process of its own, and CPU time and memory read from /proc
(Linux)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TICK_S = os.sysconf("SC_CLK_TCK")


def child_run(argv: list[str], python: str | Path = sys.executable) -> dict:
    """Run ``python argv`` (a benchmark script with ``--one``: one run, its result as the last line
    of JSON on stdout) in a process of its own, so that runs share no JVM, cache or memory; its
    result. A failed run ends the benchmark with the last of what it said."""
    done = subprocess.run([str(python), *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{Path(argv[0]).name} {' '.join(argv[1:])}: failed\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_s(pid: int) -> float:
    """User + system seconds process ``pid`` has run so far (OSError once it is gone)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK_S  # utime, stime


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...), from /proc."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def tree_cpu_s(pid: int) -> float:
    """User + system seconds of ``pid`` and every process below it that is still alive."""
    total = 0.0
    for p in (pid, *descendants(pid)):
        try:
            total += cpu_s(p)
        except OSError:
            continue
    return total


def tree_rss_mb(pid: int) -> float:
    """Resident memory (MB) of ``pid`` and every process below it that is still alive."""
    total = 0.0
    for p in (pid, *descendants(pid)):
        try:
            status = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024
    return total
