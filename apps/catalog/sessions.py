"""Job sessions over HTTP, for ``icebarrier job exec`` (and any scheduler): open (or take over)
a job's session, hold it while the run lives, publish its barrier, or release it.

Not part of the Iceberg REST spec: under ``/icebarrier/v1/jobs/{job}/session``. A token of the
job, or an admin token, may act on it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from icebarrier.apps.catalog.deps import Caller, LakeDep, acting
from icebarrier.apps.catalog.warehouses import Warehouse
from icebarrier.control_plane import job_sessions, reads
from icebarrier.control_plane.job_sessions import NoBarrierDueError
from icebarrier.control_plane.model import parse_job_name

router = APIRouter(prefix="/icebarrier/v1/jobs/{job}/session")


async def session_job(who: Caller, job: str) -> str:
    """The job named in the path, which the caller must act for."""
    return acting(who[0], Warehouse("job", job=parse_job_name(job))).job


SessionJob = Annotated[str, Depends(session_job)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OpenRequest(_Body):
    skip: bool = True  # False: the job reads the barrier itself and is never skipped
    coalesce: bool = True
    hold_s: float = Field(default=job_sessions.HOLD_S, gt=0, le=3600)


class HoldRequest(_Body):
    run_id: str
    hold_s: float = Field(default=job_sessions.HOLD_S, gt=0, le=3600)


class RunRequest(_Body):
    run_id: str | None = None  # None: whichever run holds it (a client without job exec)


@router.post("")
def open_session(job: SessionJob, lake: LakeDep, body: OpenRequest | None = None):
    """The run's session: ``opened`` says new, resumed (computing B again) or adopted (publish
    what the dead run staged); ``inputs`` the snapshots its sources load at; ``ready`` false with
    what the job waits for when it has nothing to complete now."""
    body = body or OpenRequest()
    with lake.pool.connection() as conn:
        try:
            session, how = job_sessions.open_session(conn, job, skip=body.skip, coalesce=body.coalesce,
                                                     hold_s=body.hold_s)
        except NoBarrierDueError as exc:
            return {"ready": False, "waiting": exc.plan.describe_wait(), "plan": exc.plan.to_json()}
        newest = conn.execute("SELECT max(barrier) AS b FROM barrier").fetchone()["b"]
        inputs = reads.resolve(conn, sorted(session.sources), barrier=session.barrier).snapshots \
            if session.sources else {}
    return {"ready": True, "opened": how.value, "newest_barrier": newest,
            "session": {**session.to_json(), "catalog": lake.settings.catalog,
                        "inputs": {str(t): s for t, s in sorted(inputs.items())}}}


@router.get("")
def show_session(job: SessionJob, lake: LakeDep):
    with lake.pool.connection() as conn:
        session = job_sessions.get(conn, job)
    return {"session": session.to_json() if session else None}


@router.put("/hold")
def hold_session(job: SessionJob, lake: LakeDep, body: HoldRequest):
    with lake.pool.connection() as conn:
        return {"session": job_sessions.hold(conn, job, body.run_id, body.hold_s).to_json()}


@router.post("/publish")
def publish_session(job: SessionJob, lake: LakeDep, body: RunRequest | None = None):
    with lake.pool.connection() as conn:
        return {"completion": lake.publish_session(conn, job, (body or RunRequest()).run_id).to_json()}


@router.post("/release")
def release_session(job: SessionJob, lake: LakeDep, body: HoldRequest):
    """The run ends without publishing: drop what it staged, release its hold, keep the plan."""
    with lake.pool.connection() as conn:
        return {"released": job_sessions.release(conn, job, body.run_id)}
