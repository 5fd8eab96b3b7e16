"""Server-side scan planning: ``planTableScan`` (``POST …/tables/{table}/plan``),
``fetchPlanningResult`` and ``cancelPlanning`` (``GET``/``DELETE …/plan/{plan-id}``) and
``fetchScanTasks`` (``POST …/tables/{table}/tasks``), on every warehouse.

A plan is made at the warehouse's cut: on the metadata a load of the table through the same
warehouse, token and session returns (the same grants, the same 403 and 404), so a plan without
a snapshot id plans the cut, never the newest snapshot, and a snapshot id must be one that
metadata serves (through ``barrier-<B>`` and ``read-committed`` the cut and its ancestors). Its
``storage-credentials`` are the load's. The work is :mod:`icebarrier.iceberg_ext.scan_planning`.

A plan of more than one run of data manifests (:func:`~icebarrier.iceberg_ext.scan_planning.runs`:
16 manifests, 10,000 files) answers in plan tasks, a run each. A task carries all it needs (the metadata
file, the snapshot, the run, the request, the warehouse, the table and who asked), signed with a
key the server processes share (``catalog_key``): any process answers it, after a restart too,
and a forged, altered or foreign one (another table's, warehouse's or token's) is the same 404.

A plan of more than ``--plan-submit-above`` data manifests is answered ``submitted`` at once, with
a plan id that carries the same (and when it expires, an hour on): fetching its result makes the
plan (its plan tasks), on any process. A cancelled plan id is kept (a digest, until it expires)
where every process sees it: fetching it then answers ``cancelled``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool

from icebarrier.apps.catalog.delegation import Access
from icebarrier.apps.catalog.deps import Caller, Loading, acting, loading_table
from icebarrier.apps.catalog.errors import MalformedRequestError
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.iceberg_ext import faults
from icebarrier.iceberg_ext import scan_planning as sp

router = APIRouter(prefix="/v1/{prefix}")
TABLE = "/namespaces/{namespace}/tables/{table}"
KEY_NAME = "plan-tasks"
PLAN_ID_TTL_S = 3600  # a submitted plan's result can be fetched this long


class NoSuchPlanTaskError(IcebarrierError):
    """A plan task this server did not make for this caller, warehouse and table (404)."""

    def __init__(self) -> None:
        super().__init__("no such plan task for this table and token; plan the scan again")


class NoSuchPlanIdError(IcebarrierError):
    """A plan id this server did not give this caller for this warehouse and table, or expired (404)."""

    def __init__(self) -> None:
        super().__init__("no such plan id for this table and token (or it expired); plan the scan again")


Planning = Annotated[Loading, Depends(loading_table)]


def _key(lake) -> bytes:
    """The shared signing key (made by the first server that needs it)."""
    key = getattr(lake, "_plan_task_key", None)
    if key is None:
        with lake.pool.connection() as conn:
            conn.execute(
                "INSERT INTO catalog_key (name, secret) VALUES (%s, %s) ON CONFLICT (name) DO NOTHING",
                (KEY_NAME, secrets.token_bytes(32)),
            )
            key = bytes(
                conn.execute("SELECT secret FROM catalog_key WHERE name = %s", (KEY_NAME,)).fetchone()["secret"]
            )
        lake._plan_task_key = key
    return key


def _mac(key: bytes, payload: bytes) -> bytes:
    return base64.urlsafe_b64encode(hmac.new(key, payload, hashlib.sha256).digest()).rstrip(b"=")


def _sign(key: bytes, task: dict) -> str:
    payload = base64.urlsafe_b64encode(json.dumps(task, separators=(",", ":")).encode()).rstrip(b"=")
    return f"{payload.decode()}.{_mac(key, payload).decode()}"


def _verify(key: bytes, token: object, loading: Loading, caller: str, missing: type[IcebarrierError]) -> dict:
    """What ``token`` carries, if this server signed it for this warehouse, table and caller
    (else ``missing``: one answer for every reason)."""
    if not isinstance(token, str) or token.count(".") != 1:
        raise missing()
    payload, mac = token.split(".")
    if not hmac.compare_digest(_mac(key, payload.encode()), mac.encode()):
        raise missing()
    task = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    if (task.get("w"), task.get("t"), task.get("c")) != (str(loading.warehouse), str(loading.table), caller):
        raise missing()
    return task


def _served(loading: Loading, access) -> tuple[dict, Any, Any]:
    """What a load through the same warehouse and token returns (its grants and refusals with
    it): the answer, and the metadata it serves with the server's own FileIO."""
    answer = json.loads(loading.load(access))
    if faults.mutated(faults.PLAN_AT_LATEST):  # the checker's mutation: the newest snapshot, not the cut
        with loading.lake.pool.connection() as conn:
            answer["metadata-location"] = loading.lake.current(conn, loading.table)[0]
    metadata, io = loading.lake.metadata(answer["metadata-location"])
    return answer, metadata, io


def _completed(answer: dict) -> dict:
    """A completed plan's answer so far: with the storage credentials the load gave, if any."""
    credentials = answer.get("storage-credentials")
    return {"status": "completed", **({"storage-credentials": credentials} if credentials else {})}


def _parsed(body: bytes) -> dict:
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        raise MalformedRequestError("the body is not JSON") from None
    except RecursionError:
        raise MalformedRequestError("the body is nested too deeply") from None
    if not isinstance(parsed, dict):
        raise MalformedRequestError("the body must be a JSON object")
    return parsed


def _caller_id(who) -> str:
    return who[0].client_id or "anonymous"


@router.post(TABLE + "/plan")
async def plan_table_scan(request: Request, loading: Planning, who: Caller, access: Access):
    """A completed plan: the file scan tasks, or plan tasks for a large one."""
    body = _parsed(await request.body())
    acting(who[0], loading.warehouse)  # a job session's token rules, as for a load
    scan = sp.parse_request(body)  # PlanRequestError: a 400 naming the field
    answer = await run_in_threadpool(_plan, loading, access, scan, _caller_id(who))
    request.app.state.metrics.plans.labels(loading.warehouse.kind).inc()
    return answer


def _plan(loading: Loading, access, scan: sp.ScanRequest, caller: str) -> Response:
    answer, metadata, io = _served(loading, access)
    result = _completed(answer)
    incremental = scan.start_snapshot_id is not None
    # an end without a start: every file live at it was added by then, a plan of that snapshot
    snapshot_id = next((s for s in (scan.end_snapshot_id, scan.snapshot_id) if s is not None), None)
    snapshot_id = snapshot_id if snapshot_id is not None else metadata.current_snapshot_id
    if snapshot_id is None:  # the table had no snapshot at the cut
        return _json({**result, "file-scan-tasks": []})
    for field, wanted in (("snapshot-id", snapshot_id), ("start-snapshot-id", scan.start_snapshot_id)):
        if wanted is not None and metadata.snapshot_by_id(wanted) is None:
            raise MalformedRequestError(
                f"{'end-snapshot-id' if incremental and field == 'snapshot-id' else field} {wanted} is not served "
                f"through warehouse {loading.warehouse} (its cut of {loading.table} is snapshot "
                f"{metadata.current_snapshot_id} and its ancestors); plan without it, or through warehouse latest"
            )
    schema = sp.bind_request(metadata, scan)
    cache = loading.lake.manifest_cache
    data, deletes, added_by = sp.manifests_of(metadata, io, snapshot_id, scan.start_snapshot_id, cache)
    if len(sp.runs(data)) <= 1 and len(data) <= loading.lake.plan_submit_above:  # answered inline
        tasks = sp.plan_files(metadata, io, schema, scan, data, deletes, added_by, cache)
        return _json({**result, **sp.scan_tasks_json(tasks, metadata, schema, scan)})
    common = {
        "w": str(loading.warehouse),
        "t": str(loading.table),
        "c": caller,
        "m": answer["metadata-location"],
        "s": snapshot_id,
        "q": scan.to_json() | ({} if incremental else {"snapshot-id": snapshot_id}),
    }
    key = _key(loading.lake)
    if len(data) > loading.lake.plan_submit_above:
        plan_id = _sign(key, {**common, "x": int(time.time()) + PLAN_ID_TTL_S})
        return _json({"status": "submitted", "plan-id": plan_id})
    return _json({**result, "plan-tasks": _plan_tasks(key, common, data)})


def _plan_tasks(key: bytes, common: dict, data: list) -> list[str]:
    """The plan tasks of a plan over ``data`` manifests: a run of them each."""
    return [_sign(key, {**common, "r": [lo, hi]}) for lo, hi in sp.runs(data)]


def _cancelled_digest(plan_id: str) -> str:
    return hashlib.sha256(plan_id.encode()).hexdigest()


@router.get(TABLE + "/plan/{plan_id}")
async def fetch_planning_result(plan_id: str, loading: Planning, who: Caller, access: Access):
    """A submitted plan's result: its plan tasks (made now), or ``cancelled``."""
    return await run_in_threadpool(_result, loading, access, plan_id, _caller_id(who))


def _submitted(loading: Loading, plan_id: str, caller: str) -> dict:
    """What a plan id this server gave ``caller`` carries, while it lives (else NoSuchPlanIdError)."""
    plan = _verify(_key(loading.lake), plan_id, loading, caller, NoSuchPlanIdError)
    if "x" not in plan or plan["x"] < time.time():  # a plan task, or expired
        raise NoSuchPlanIdError()
    return plan


def _result(loading: Loading, access, plan_id: str, caller: str) -> Response:
    plan = _submitted(loading, plan_id, caller)
    with loading.lake.pool.connection() as conn:
        if conn.execute("SELECT 1 FROM cancelled_plan WHERE digest = %s", (_cancelled_digest(plan_id),)).fetchone():
            return _json({"status": "cancelled"})
    answer = json.loads(loading.load(access))  # the grants again, and the credentials a load gets now
    metadata, io = loading.lake.metadata(plan["m"])
    scan = sp.parse_request(plan["q"])
    try:
        data, _, _ = sp.manifests_of(metadata, io, plan["s"], scan.start_snapshot_id, loading.lake.manifest_cache)
    except FileNotFoundError:  # expired since: its manifests are gone
        raise NoSuchPlanIdError() from None
    common = {k: plan[k] for k in ("w", "t", "c", "m", "s", "q")}
    result = _completed(answer) | {"plan-id": plan_id}
    return _json({**result, "plan-tasks": _plan_tasks(_key(loading.lake), common, data)})


@router.delete(TABLE + "/plan/{plan_id}")
async def cancel_planning(plan_id: str, loading: Planning, who: Caller):
    """Forget a submitted plan: fetching its result answers ``cancelled`` from any process."""
    await run_in_threadpool(_cancel, loading, plan_id, _caller_id(who))
    return Response(status_code=204)


def _cancel(loading: Loading, plan_id: str, caller: str) -> None:
    plan = _submitted(loading, plan_id, caller)
    with loading.lake.pool.connection() as conn:
        conn.execute("DELETE FROM cancelled_plan WHERE expires_at < now()")
        conn.execute(
            "INSERT INTO cancelled_plan (digest, expires_at) VALUES (%s, to_timestamp(%s)) ON CONFLICT DO NOTHING",
            (_cancelled_digest(plan_id), plan["x"]),
        )


@router.post(TABLE + "/tasks")
async def fetch_scan_tasks(request: Request, loading: Planning, who: Caller):
    """The file scan tasks of one plan task."""
    body = _parsed(await request.body())
    if not isinstance(body.get("plan-task"), str):
        raise NoSuchPlanTaskError()  # none given: nothing this server made
    return await run_in_threadpool(_tasks, loading, body["plan-task"], _caller_id(who), who[0])


def _tasks(loading: Loading, token: str, caller: str, principal) -> Response:
    task = _verify(_key(loading.lake), token, loading, caller, NoSuchPlanTaskError)
    if "r" not in task:  # a plan id is no plan task
        raise NoSuchPlanTaskError()
    acting(principal, loading.warehouse).require_read(loading.table)  # still granted
    scan = sp.parse_request(task["q"])
    metadata, io = loading.lake.metadata(task["m"])
    cache = loading.lake.manifest_cache
    try:
        data, deletes, added_by = sp.manifests_of(metadata, io, task["s"], scan.start_snapshot_id, cache)
    except FileNotFoundError:  # expired since: its manifests are gone
        raise NoSuchPlanTaskError() from None
    lo, hi = task["r"]
    schema = sp.bind_request(metadata, scan)
    tasks = sp.plan_files(metadata, io, schema, scan, data[lo:hi], deletes, added_by, cache)
    return _json(sp.scan_tasks_json(tasks, metadata, schema, scan))


def _json(body: dict) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), media_type="application/json")
