"""The checker's fault schedule: a pure function of the seed (which job is killed when, which
fault point each launch arms, when the control-plane Postgres restarts and for how long, when
the catalog server is killed or stopped, when the maintenance service is killed)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from icebarrier.apps.check.exec_jobs import EXEC_JOBS
from icebarrier.apps.check.model import JOBS
from icebarrier.iceberg_ext import faults


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float
    # kill (a job process, -9: for a job exec job, `job exec` itself), script (a job exec job's
    # script alone, -9), restart (the control-plane Postgres), server (the catalog server, -9,
    # started again down_s later), server-term (the same with SIGTERM: it drains, then exits),
    # maintain (the maintenance service, -9, started again down_s later)
    kind: str
    job: str | None = None
    down_s: float = 0.0


def fault_schedule(
    seed: int, duration_s: float, fault_rate: float, *, restarts: bool, exec_jobs: bool = False, maintain: bool = False
) -> list[Fault]:
    rng = random.Random(f"{seed}:schedule")
    kills = [
        Fault(at_s=rng.uniform(0.5, duration_s), kind="kill", job=rng.choice(JOBS))
        for _ in range(round(duration_s * fault_rate * 0.7))
    ]
    downs = [
        Fault(at_s=rng.uniform(1.0, duration_s), kind="restart", down_s=round(rng.uniform(0.2, 1.5), 2))
        for _ in range(max(1, round(duration_s / 10)) if restarts else 0)
    ]
    scripts = [
        Fault(at_s=rng.uniform(0.5, duration_s), kind="script", job=rng.choice(list(EXEC_JOBS)))
        for _ in range(round(duration_s * fault_rate * 0.3) if exec_jobs else 0)
    ]
    servers = [  # every other one a SIGTERM (the server drains), the others -9
        Fault(
            at_s=rng.uniform(1.0, duration_s),
            kind="server-term" if i % 2 else "server",
            down_s=round(rng.uniform(0.2, 1.5), 2),
        )
        for i in range(max(2, round(duration_s * fault_rate / 6)) if exec_jobs else 0)
    ]
    maintains = [  # drawn last: the schedule without --maintain stays what it was for a seed
        Fault(at_s=rng.uniform(1.0, duration_s), kind="maintain", down_s=round(rng.uniform(0.2, 1.5), 2))
        for _ in range(max(1, round(duration_s * fault_rate / 6)) if maintain else 0)
    ]
    return sorted(kills + downs + scripts + servers + maintains, key=lambda f: f.at_s)


def launch_fault(seed: int, job: str, launch_no: int, fault_rate: float) -> tuple[str | None, int]:
    """The fault point (and how many times it passes first) armed for a job's n-th launch."""
    rng = random.Random(f"{seed}:{job}:{launch_no}")
    if rng.random() >= fault_rate:
        return None, 0
    return rng.choice(faults.POINTS), rng.randrange(0, 3)
