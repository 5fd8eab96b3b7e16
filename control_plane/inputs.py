"""Announced external inputs (DESIGN.md, "Cost per barrier follows the jobs with work").

A root job reads external inputs the control plane cannot see into, so by default it runs at
every barrier to find out whether data arrived. Once its inputs are *announced* — whoever lands
the data (a loader, a sensor, a Kafka offset poller) says so after each arrival — a root job
whose inputs brought nothing since its progress is skipped with the rest, by the control plane,
and its process is woken only by an announcement. An input stays announced until forgotten;
the first announcement counts as an arrival (what came before is read at the next barrier).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from icebarrier.control_plane.db import Conn, call
from icebarrier.control_plane.model import parse_external_input


@dataclass(frozen=True, slots=True)
class Input:
    name: str
    announced_at: datetime
    announced_by: str
    jobs: tuple[str, ...]  # the active jobs that read it

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "announced_at": self.announced_at.isoformat(),
            "announced_by": self.announced_by,
            "jobs": list(self.jobs),
        }


def announce(conn: Conn, names: list[str]) -> None:
    """Data arrived in ``names``: the root jobs reading them run at the next barrier (the admin,
    or a role acting for a job that reads each)."""
    checked = sorted({parse_external_input(n) for n in names})
    with conn.transaction():
        call(conn, "announce_inputs", checked)


def forget(conn: Conn, names: list[str]) -> int:
    """``names`` are no longer announced: their root jobs run at every barrier again (the admin)."""
    checked = sorted({parse_external_input(n) for n in names})
    with conn.transaction():
        return call(conn, "forget_inputs", checked)[0]["forget_inputs"]


def list_inputs(conn: Conn) -> list[Input]:
    rows = conn.execute("SELECT name, announced_at, announced_by, jobs FROM external_inputs ORDER BY name").fetchall()
    return [Input(r["name"], r["announced_at"], r["announced_by"], tuple(r["jobs"])) for r in rows]
