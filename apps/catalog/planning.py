"""Server-side scan planning: ``planTableScan`` (``POST …/tables/{table}/plan``) and
``fetchScanTasks`` (``POST …/tables/{table}/tasks``), on every warehouse.

A plan is made at the warehouse's cut: on the metadata a load of the table through the same
warehouse, token and session returns (the same grants, the same 403 and 404), so a plan without
a snapshot id plans the cut, never the newest snapshot, and a snapshot id must be one that
metadata serves (through ``barrier-<B>`` and ``read-committed`` the cut and its ancestors). Its
``storage-credentials`` are the load's. The work is :mod:`icebarrier.iceberg_ext.scan_planning`.

A plan of more than :data:`~icebarrier.iceberg_ext.scan_planning.PLAN_TASK_MANIFESTS` data
manifests answers in plan tasks, each a run of them. A task carries all it needs (the metadata
file, the snapshot, the run, the request, the warehouse, the table and who asked), signed with a
key the server processes share (``catalog_key``): any process answers it, after a restart too,
and a forged, altered or foreign one (another table's, warehouse's or token's) is the same 404.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool

from icebarrier.apps.catalog.delegation import Access
from icebarrier.apps.catalog.deps import Caller, Loading, acting, loading_table
from icebarrier.apps.catalog.errors import MalformedRequestError
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.iceberg_ext import scan_planning as sp

router = APIRouter(prefix="/v1/{prefix}")
TABLE = "/namespaces/{namespace}/tables/{table}"
KEY_NAME = "plan-tasks"


class NoSuchPlanTaskError(IcebarrierError):
    """A plan task this server did not make for this caller, warehouse and table (404)."""

    def __init__(self) -> None:
        super().__init__("no such plan task for this table and token; plan the scan again")


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


def _sign(key: bytes, task: dict) -> str:
    payload = base64.urlsafe_b64encode(json.dumps(task, separators=(",", ":")).encode()).rstrip(b"=")
    mac = base64.urlsafe_b64encode(hmac.new(key, payload, hashlib.sha256).digest()).rstrip(b"=")
    return f"{payload.decode()}.{mac.decode()}"


def _verify(key: bytes, token: object) -> dict:
    if not isinstance(token, str) or token.count(".") != 1:
        raise NoSuchPlanTaskError()
    payload, mac = token.split(".")
    expected = base64.urlsafe_b64encode(hmac.new(key, payload.encode(), hashlib.sha256).digest()).rstrip(b"=")
    if not hmac.compare_digest(expected, mac.encode()):
        raise NoSuchPlanTaskError()
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def _served(loading: Loading, access) -> tuple[dict, object, object]:
    """What a load through the same warehouse and token returns (its grants and refusals with
    it): the answer, and the metadata it serves with the server's own FileIO."""
    answer = json.loads(loading.load(access))
    metadata, io = loading.lake.metadata(answer["metadata-location"])
    return answer, metadata, io


def _parsed(body: bytes) -> dict:
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        raise MalformedRequestError("the body is not JSON") from None
    if not isinstance(parsed, dict):
        raise MalformedRequestError("the body must be a JSON object")
    return parsed


def _refused(exc: sp.PlanRequestError) -> MalformedRequestError:
    return MalformedRequestError(str(exc))


def _caller_id(who) -> str:
    return who[0].client_id or "anonymous"


@router.post(TABLE + "/plan")
async def plan_table_scan(request: Request, loading: Planning, who: Caller, access: Access):
    """A completed plan: the file scan tasks, or plan tasks for a large one."""
    body = _parsed(await request.body())
    acting(who[0], loading.warehouse)  # a job session's token rules, as for a load
    try:
        scan = sp.parse_request(body)
    except sp.PlanRequestError as exc:
        raise _refused(exc) from None
    answer = await run_in_threadpool(_plan, loading, access, scan, _caller_id(who))
    request.app.state.metrics.plans.labels(loading.warehouse.kind).inc()
    return answer


def _plan(loading: Loading, access, scan: sp.ScanRequest, caller: str) -> Response:
    answer, metadata, io = _served(loading, access)
    result: dict = {"status": "completed"}
    if answer.get("storage-credentials"):
        result["storage-credentials"] = answer["storage-credentials"]
    incremental = scan.start_snapshot_id is not None
    snapshot_id = scan.end_snapshot_id if incremental else scan.snapshot_id
    snapshot_id = snapshot_id if snapshot_id is not None else metadata.current_snapshot_id
    if snapshot_id is None:  # the table had no snapshot at the cut
        return _json({**result, "file-scan-tasks": []})
    for key, wanted in (("snapshot-id", snapshot_id), ("start-snapshot-id", scan.start_snapshot_id)):
        if wanted is not None and metadata.snapshot_by_id(wanted) is None:
            raise MalformedRequestError(
                f"{'end-snapshot-id' if incremental and key == 'snapshot-id' else key} {wanted} is not served "
                f"through warehouse {loading.warehouse} (its cut of {loading.table} is snapshot "
                f"{metadata.current_snapshot_id} and its ancestors); plan without it, or through warehouse latest"
            )
    try:
        schema = sp.bind_request(metadata, scan)
        data, deletes = sp.data_manifests(
            metadata, metadata.snapshot_by_id(snapshot_id), io, loading.lake.manifest_cache
        )
        added_by = sp.between(metadata, scan.start_snapshot_id, snapshot_id) if incremental else None
        if added_by is not None:
            data = sp.added_since(metadata, data, scan.start_snapshot_id)
        if len(data) <= sp.PLAN_TASK_MANIFESTS:
            tasks = sp.plan_files(metadata, io, schema, scan, data, deletes, added_by, loading.lake.manifest_cache)
            return _json({**result, **sp.scan_tasks_json(tasks, metadata, schema, scan)})
    except sp.PlanRequestError as exc:
        raise _refused(exc) from None
    key = _key(loading.lake)
    common = {
        "w": str(loading.warehouse),
        "t": str(loading.table),
        "c": caller,
        "m": answer["metadata-location"],
        "s": snapshot_id,
        "q": scan.to_json() | ({} if incremental else {"snapshot-id": snapshot_id}),
    }
    runs = range(0, len(data), sp.PLAN_TASK_MANIFESTS)
    return _json(
        {**result, "plan-tasks": [_sign(key, {**common, "r": [lo, lo + sp.PLAN_TASK_MANIFESTS]}) for lo in runs]}
    )


@router.post(TABLE + "/tasks")
async def fetch_scan_tasks(request: Request, loading: Planning, who: Caller):
    """The file scan tasks of one plan task."""
    body = _parsed(await request.body())
    if not isinstance(body.get("plan-task"), str):
        raise NoSuchPlanTaskError()  # none given: nothing this server made
    return await run_in_threadpool(_tasks, loading, body["plan-task"], _caller_id(who), who[0])


def _tasks(loading: Loading, token: str, caller: str, principal) -> Response:
    task = _verify(_key(loading.lake), token)
    if (task.get("w"), task.get("t"), task.get("c")) != (str(loading.warehouse), str(loading.table), caller):
        raise NoSuchPlanTaskError()
    acting(principal, loading.warehouse).require_read(loading.table)  # still granted
    scan = sp.parse_request(task["q"])
    metadata, io = loading.lake.metadata(task["m"])
    try:
        data, deletes = sp.data_manifests(metadata, metadata.snapshot_by_id(task["s"]), io, loading.lake.manifest_cache)
        added_by = sp.between(metadata, scan.start_snapshot_id, task["s"]) if scan.start_snapshot_id else None
        if added_by is not None:
            data = sp.added_since(metadata, data, scan.start_snapshot_id)
    except FileNotFoundError:  # expired since: its manifests are gone
        raise NoSuchPlanTaskError() from None
    lo, hi = task["r"]
    schema = sp.bind_request(metadata, scan)
    tasks = sp.plan_files(metadata, io, schema, scan, data[lo:hi], deletes, added_by, loading.lake.manifest_cache)
    return _json(sp.scan_tasks_json(tasks, metadata, schema, scan))


def _json(body: dict) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), media_type="application/json")
