"""Job sessions over HTTP, for ``icebarrier job exec`` (and any scheduler): open (or take over)
a job's session, hold it while the run lives, publish its barrier, or release it.

Not part of the Iceberg REST spec: under ``/icebarrier/v1/jobs/{job}/session``. A token of the
job, or an admin token, may act on it.
"""

from __future__ import annotations

import json
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from icebarrier.apps.catalog.deps import Caller, LakeDep, acting, token_holder
from icebarrier.apps.catalog.errors import error_response
from icebarrier.apps.catalog.idempotency import Write, Writes
from icebarrier.apps.catalog.notices import Parked, Voice, replan_s
from icebarrier.apps.catalog.warehouses import Warehouse
from icebarrier.control_plane import job_sessions, reads
from icebarrier.control_plane.model import parse_job_name
from icebarrier.control_plane.notices import Wait

router = APIRouter(prefix="/icebarrier/v1/jobs/{job}/session")
NDJSON = "application/x-ndjson"


async def session_job(who: Caller, job: str) -> str:
    """The job named in the path, which the caller must act for."""
    return _acting_job(who[0], job)


def _acting_job(principal, job: str) -> str:
    return acting(principal, Warehouse("job", job=parse_job_name(job))).acting_job


SessionJob = Annotated[str, Depends(session_job)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OpenRequest(_Body):
    skip: bool = True  # False: the job reads the barrier itself and is never skipped
    coalesce: bool = True
    hold_s: float = Field(default=job_sessions.HOLD_S, gt=0, le=3600)
    # nothing to complete now: wait up to this long (a long poll)
    wait_s: float = Field(default=0, ge=0, le=job_sessions.MAX_WAIT_S)


class HoldRequest(_Body):
    run_id: str
    hold_s: float = Field(default=job_sessions.HOLD_S, gt=0, le=3600)


class RunRequest(_Body):
    run_id: str | None = None  # None: whichever run holds it (a client without job exec)


def _open(once: Write, job: str, body: OpenRequest) -> tuple[job_sessions.Opening | None, dict]:
    """Open the job's session, in one transaction with what the run needs to know of it (the
    opening is None where the answer is a retry's, given again)."""
    found: list[job_sessions.Opening] = []

    def open_(conn) -> JSONResponse:
        opening = job_sessions.open_session(conn, job, skip=body.skip, coalesce=body.coalesce, hold_s=body.hold_s)
        found.append(opening)
        skipped = [c.barrier for c in opening.skipped]
        if opening.session is None:
            return JSONResponse(
                {
                    "ready": False,
                    "waiting": opening.waits_for.describe_wait(),
                    "plan": opening.waits_for.to_json(),
                    "skipped": skipped,
                }
            )
        session = opening.session
        inputs = (
            reads.resolve(conn, sorted(session.sources), barrier=session.barrier).snapshots if session.sources else {}
        )
        return JSONResponse(
            {
                "ready": True,
                "opened": opening.opened.value,
                "newest_barrier": opening.newest_barrier,
                "skipped": skipped,
                "session": {
                    **session.to_json(),
                    "catalog": once.lake.settings.catalog,
                    "inputs": {str(t): s for t, s in sorted(inputs.items())},
                },
            }
        )

    response = once.run(open_, final=lambda r: r.status_code != 200 or json.loads(bytes(r.body))["ready"])
    answer = json.loads(bytes(response.body))
    if response.status_code != 200:
        return None, answer  # a refusal given again
    return (found[-1] if found else None), answer


@router.post("")
async def open_session(job: SessionJob, who: Caller, once: Writes, request: Request, body: OpenRequest | None = None):
    """The run's session: ``opened`` says new, resumed (computing B again) or adopted (publish
    what the dead run staged); ``inputs`` the snapshots its sources load at; ``ready`` false with
    what the job waits for when it has nothing to complete now. ``skipped``: the barriers
    completed on the way with no computation (no source changed).

    ``wait_s``: with nothing to complete now, wait up to that long for something (a long poll):
    the answer is then a stream of JSON lines — ``{"skipped": [B…]}`` as the server skips
    barriers for the job, ``{"waiting": WHAT}`` at once and every heartbeat (``serve --heartbeat``) with
    nothing else to say,
    and last the answer above (or ``{"error": …}``). The server plans
    again only when a notice concerns the job (a barrier issued for a root job, its sources'
    watermarks moving): waiting costs the database nothing.

    With an ``Idempotency-Key``, the answer that opens a session is final (a retry gets it
    again: the same run); an answer with nothing to do is not (a retry waits again)."""
    body = body or OpenRequest()
    hub = request.app.state.hub
    deadline, key = time.monotonic() + body.wait_s, (job, body.skip, body.coalesce)
    if body.wait_s > 0 and (parked := hub.unpark(key)) is not None:  # nothing new since its last long poll
        hub.events["renewed"] += 1
        return LongPoll(hub, key, once, body, parked, deadline, who[1])
    watch = hub.watch() if body.wait_s > 0 and not hub.closing else None  # before planning: a notice meanwhile is kept
    streaming = False
    try:
        opening, answer = await run_in_threadpool(_open, once, job, body)
        hub.events["planned"] += 1
        if opening is None or answer["ready"] or watch is None:
            return JSONResponse(answer, status_code=answer["error"]["code"] if "error" in answer else 200)
        streaming = True
        parked = Parked(watch, _wait(job, opening), opening, answer)
        return LongPoll(hub, key, once, body, parked, deadline, who[1])
    finally:
        if watch is not None and not streaming:
            hub.forget(watch)


class LongPoll(StreamingResponse):
    """A long poll's stream: the lines :func:`_waiting` yields, and between them its
    :class:`Voice`'s line, which the hub says every heartbeat through this stream's ``send``."""

    def __init__(self, hub, key: tuple, once: Write, body: OpenRequest, at: Parked, deadline: float, token: str | None):
        self.voice = Voice()
        super().__init__(_waiting(hub, key, once, body, at, deadline, token, self.voice), media_type=NDJSON)

    async def stream_response(self, send) -> None:
        self.voice.send = send
        try:
            await super().stream_response(send)
        finally:
            self.voice.line = None


async def _waiting(
    hub, key: tuple, once: Write, body: OpenRequest, at: Parked, deadline: float, token: str | None, voice: Voice
):
    """The long poll's lines: what it waits for (the hub says it again every heartbeat), the
    barriers skipped as they are, then the answer. One that ends with nothing new is parked for
    the job's next ask (before its last line: the ask may follow at once)."""
    job = key[0]
    try:
        if at.answer.get("skipped"):
            yield _line({"skipped": at.answer["skipped"]})
            at.answer = {**at.answer, "skipped": []}  # said: a renewal that takes it up says nothing of them
        voice.line = _waiting_line(at)
        yield voice.line
        hub.speak(voice)  # and the hub says it every heartbeat: alive through proxies
        while True:
            woke = await at.watch.until(at.wait, limit_s=deadline - time.monotonic())
            if hub.closing:
                break
            if not woke and at.wait.remaining_s() > 0:  # the long poll's end, nothing new: the client asks again
                hub.park(key, at)
                break
            try:
                if token is not None:  # checked again: a long poll plans long after its request came
                    _acting_job(await token_holder(once.lake, token), job)  # a token revoked meanwhile opens nothing
                found, answer = await run_in_threadpool(_open, once, job, body)
                hub.events["woken" if woke else "due"] += 1
            except Exception as exc:  # noqa: BLE001 - the stream has begun: the error is its last line
                yield _last(voice, json.loads(bytes(error_response(exc).body)))
                return
            if found is None:  # a refusal given again
                yield _last(voice, answer)
                return
            if answer.get("skipped"):
                yield _line({"skipped": answer["skipped"]})
            if answer["ready"]:
                yield _last(voice, {**answer, "skipped": []})
                return
            at = Parked(at.watch, _wait(job, found), found, answer)
            voice.line = _waiting_line(at)
            if deadline <= time.monotonic():
                break
        yield _last(voice, {**at.answer, "skipped": []})
    finally:
        if hub.parked(key) is not at:
            hub.forget(at.watch)


def _wait(job: str, opening: job_sessions.Opening) -> Wait:
    """What wakes the job's long poll: its notices, or its clock's next barrier, or the job's own
    point of every 15 minutes (:func:`replan_s`, a safety net: a long poll, or its job's next,
    plans again from the database)."""
    plan = opening.waits_for
    return Wait.of(plan, root=plan.root, due_in_s=opening.due_in_s, safety_s=replan_s(job))


def _waiting_line(at: Parked) -> bytes:
    """The line that says what the job waits for (at once, and every heartbeat until it plans again)."""
    return _line({"waiting": at.opening.waits_for.describe_wait()})


def _last(voice: Voice, item: dict) -> bytes:
    """The stream's last line (the answer): the hub says nothing after it."""
    voice.line = None
    return _line(item)


def _line(item: dict) -> bytes:
    return json.dumps(item).encode() + b"\n"


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
def publish_session(job: SessionJob, lake: LakeDep, once: Writes, body: RunRequest | None = None):
    """Publish the run's barrier. The run's success is noted first, in a transaction of its own,
    so that a publish cut short is adopted by the job's next run."""
    run_id = (body or RunRequest()).run_id
    with lake.pool.connection() as conn:
        job_sessions.note_succeeded(conn, job, run_id)
        response = once.run_on(
            conn, lambda conn: JSONResponse({"completion": lake.publish_session(conn, job, run_id).to_json()})
        )
        if response.status_code == 409:  # a sink moved under the run (not by expiry alone): its next run
            job_sessions.compute_again(conn, job, run_id)  # computes the barrier again, never adopts this
        return response


@router.post("/release")
def release_session(job: SessionJob, once: Writes, body: HoldRequest):
    """The run ends without publishing: drop what it staged, release its hold, keep the plan."""
    return once.run(lambda conn: JSONResponse({"released": job_sessions.release(conn, job, body.run_id)}))
