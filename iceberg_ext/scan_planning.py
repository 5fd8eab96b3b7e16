"""Scan planning on the server: the REST spec's ``planTableScan`` and ``fetchScanTasks`` bodies,
from a table's metadata and its manifests.

A request is parsed as the spec has it (:func:`parse_request`), its filter in either form
clients send (the older ``term``/``value``, PyIceberg's; the newer ``child``/``left``/``right``
with references, typed literals and functions); what PyIceberg's expressions cannot hold prunes
nothing (it stays in the residual the client applies). The plan is PyIceberg's own
(:class:`pyiceberg.table.ManifestGroupPlanner`: partition summaries, partition values and
column statistics; position deletes matched to data files; equality deletes, which it refuses,
matched by :func:`equality_deletes_of`), over all of a snapshot's data manifests
or one run of them (a plan task), with every delete manifest. A manifest never changes once
written, so its entries are read and decoded once and kept (:class:`ManifestCache`, least
recently used first out, bounded by entries) for every later plan of every client. Its tasks go
out in the spec's JSON (:func:`scan_tasks_json`), with the client's own filter as each task's
residual.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from icebarrier.control_plane.errors import IcebarrierError

PLAN_TASK_MANIFESTS = 16  # data manifests a plan answers inline, and each plan task's share beyond
PLAN_TASK_FILES = 10_000  # and the files they list at most (a manifest of more is a task of its own)
CACHED_ENTRIES = 200_000  # manifest entries a server process keeps decoded (about 2 KB each)
CACHED_LISTS = 4_096  # manifest lists it keeps read
PLAN_SUBMIT_ABOVE = 512  # data manifests past which a plan is answered submitted (`serve --plan-submit-above`)

_CONTENT = {0: "data", 1: "position-deletes", 2: "equality-deletes"}
_LOGICAL = {"and", "or"}
_UNARY = {"is-null", "not-null", "is-nan", "not-nan"}
_LITERAL = {"lt", "lt-eq", "gt", "gt-eq", "eq", "not-eq", "starts-with", "not-starts-with"}
_SET = {"in", "not-in"}


class PlanRequestError(IcebarrierError):
    """A request the spec does not allow, or one that names what the table does not have; the
    message names the field."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ScanRequest:
    snapshot_id: int | None = None
    start_snapshot_id: int | None = None
    end_snapshot_id: int | None = None
    select: tuple[str, ...] | None = None
    filter_json: Any = None  # as the client sent it: each task's residual
    case_sensitive: bool = True
    use_snapshot_schema: bool = False
    stats_fields: tuple[str, ...] | None = None
    min_rows_requested: int | None = None

    def row_filter(self, schema):
        """The filter as PyIceberg's expression, its field ids named by ``schema``."""
        from pyiceberg.expressions import AlwaysTrue

        return AlwaysTrue() if self.filter_json is None else filter_from_json(self.filter_json, schema)

    def to_json(self) -> dict:
        return {
            "snapshot-id": self.snapshot_id,
            "start-snapshot-id": self.start_snapshot_id,
            "end-snapshot-id": self.end_snapshot_id,
            "select": list(self.select) if self.select is not None else None,
            "filter": self.filter_json,
            "case-sensitive": self.case_sensitive,
            "use-snapshot-schema": self.use_snapshot_schema,
            "stats-fields": list(self.stats_fields) if self.stats_fields is not None else None,
            "min-rows-requested": self.min_rows_requested,
        }


def _typed(body: dict, key: str, kind: type | tuple[type, ...], what: str):
    value = body.get(key)
    if value is None:
        return None
    if kind is int and isinstance(value, float) and value.is_integer():  # JSON Schema's integer
        value = int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PlanRequestError(f"{key} must be {what}, not {value!r}")
    return value


def _names(body: dict, key: str) -> tuple[str, ...] | None:
    value = _typed(body, key, list, "a list of field names")
    if value is not None and not all(isinstance(v, str) for v in value):
        raise PlanRequestError(f"{key} must be a list of field names, not {value!r}")
    return tuple(value) if value is not None else None


def parse_request(body: object) -> ScanRequest:
    """A PlanTableScanRequest (PlanRequestError naming the first bad field)."""
    if not isinstance(body, dict):
        raise PlanRequestError("the body must be a PlanTableScanRequest object")
    request = ScanRequest(
        snapshot_id=_typed(body, "snapshot-id", int, "a snapshot id"),
        start_snapshot_id=_typed(body, "start-snapshot-id", int, "a snapshot id"),
        end_snapshot_id=_typed(body, "end-snapshot-id", int, "a snapshot id"),
        select=_names(body, "select"),
        filter_json=body.get("filter"),
        case_sensitive=_typed(body, "case-sensitive", bool, "true or false") is not False,
        use_snapshot_schema=bool(_typed(body, "use-snapshot-schema", bool, "true or false")),
        stats_fields=_names(body, "stats-fields"),
        min_rows_requested=_typed(body, "min-rows-requested", int, "a number of rows"),
    )
    ranged = request.start_snapshot_id is not None or request.end_snapshot_id is not None
    if request.snapshot_id is not None and ranged:
        raise PlanRequestError("snapshot-id and start-snapshot-id/end-snapshot-id exclude each other: send one")
    if request.start_snapshot_id is not None and request.end_snapshot_id is None:
        raise PlanRequestError("start-snapshot-id needs end-snapshot-id (an incremental scan has both)")
    if request.min_rows_requested is not None and request.min_rows_requested < 0:
        raise PlanRequestError(f"min-rows-requested must not be negative, not {request.min_rows_requested}")
    if request.filter_json is not None:
        try:
            filter_from_json(request.filter_json)  # malformed: refused now
        except RecursionError:
            raise PlanRequestError("filter: nested too deeply") from None
    return request


def filter_from_json(node: Any, schema=None, positive: bool = True):
    """PyIceberg's expression of a spec ``Predicate``, in either form: the older one (``term``,
    ``value``) or the newer (``child``, ``left``/``right``: references by name or by field id,
    literals bare or typed, function applications). What PyIceberg's expressions cannot hold (a
    transform, a function, two references compared, a field id without ``schema`` to name it)
    becomes what prunes nothing where it stands: true, or false under a NOT."""
    from pyiceberg import expressions as e

    nothing = e.AlwaysTrue() if positive else e.AlwaysFalse()
    if isinstance(node, bool):
        return e.AlwaysTrue() if node else e.AlwaysFalse()
    if not isinstance(node, dict) or not isinstance(node.get("type"), str):
        raise PlanRequestError(f"filter: a predicate must be true, false or an object with a type, not {node!r}")
    kind = node["type"]
    if kind in ("true", "false"):
        return e.AlwaysTrue() if kind == "true" else e.AlwaysFalse()
    if kind in _LOGICAL:
        left, right = (filter_from_json(_child(node, side), schema, positive) for side in ("left", "right"))
        return e.And(left, right) if kind == "and" else e.Or(left, right)
    if kind == "not":
        return e.Not(filter_from_json(_child(node, "child"), schema, not positive))
    try:
        if kind in _UNARY:
            name = _operand(_either(node, "child", "term"), schema)
            unary: Any = {"is-null": e.IsNull, "not-null": e.NotNull, "is-nan": e.IsNaN, "not-nan": e.NotNaN}[kind]
            return nothing if name is None else unary(name)
        if kind in _LITERAL:
            return _comparison(node, kind, schema) or nothing
        if kind in _SET:
            name = _operand(_either(node, "child", "term"), schema)
            values = _literals(node.get("values"), kind)
            member: Any = e.In if kind == "in" else e.NotIn
            return nothing if name is None else member(name, values)
    except PlanRequestError:
        raise
    except (TypeError, ValueError) as exc:
        raise PlanRequestError(f"filter: {kind}: {exc}") from None
    raise PlanRequestError(f"filter: unknown predicate type {kind!r}")


_FLIPPED = {"lt": "gt", "lt-eq": "gt-eq", "gt": "lt", "gt-eq": "lt-eq", "eq": "eq", "not-eq": "not-eq"}


def _comparison(node: dict, kind: str, schema):
    """A comparison of a field and a literal (None: anything else, which prunes nothing)."""
    from pyiceberg import expressions as e

    if "left" in node or "right" in node:
        left, right = _child(node, "left"), _child(node, "right")
        if _is_literal(left) and not _is_literal(right):  # 5 < x: x > 5
            if kind not in _FLIPPED:
                return None
            left, right, kind = right, left, _FLIPPED[kind]
        if _is_literal(left) or not _is_literal(right):
            return None  # two literals, or two fields / functions: nothing to prune with
        name, value = _operand(left, schema), _literal(right)
    else:
        if "value" not in node:
            raise PlanRequestError(f"filter: a {kind} predicate needs a value (or left and right)")
        name, value = _operand(_child(node, "term"), schema), _literal(node["value"])
    if name is None:
        return None
    cls: Any = {
        "lt": e.LessThan,
        "lt-eq": e.LessThanOrEqual,
        "gt": e.GreaterThan,
        "gt-eq": e.GreaterThanOrEqual,
        "eq": e.EqualTo,
        "not-eq": e.NotEqualTo,
        "starts-with": e.StartsWith,
        "not-starts-with": e.NotStartsWith,
    }[kind]
    return cls(name, value)


def _child(node: dict, key: str) -> Any:
    if key not in node:
        raise PlanRequestError(f"filter: a {node['type']} predicate needs {key}")
    return node[key]


def _either(node: dict, key: str, legacy: str) -> Any:
    if key not in node and legacy not in node:
        raise PlanRequestError(f"filter: a {node['type']} predicate needs {key}")
    return node[key] if key in node else node[legacy]


def _operand(term: Any, schema) -> str | None:
    """A field's name; None for what is not a plain field (a transform, a function, a field id
    without a schema)."""
    if isinstance(term, str):
        return term
    if isinstance(term, dict) and term.get("type") == "reference":
        if isinstance(term.get("name"), str):
            return term["name"]
        if isinstance(term.get("id"), int) and not isinstance(term["id"], bool):
            if schema is None:
                return None
            name = schema.find_column_name(term["id"])
            if name is None:
                raise PlanRequestError(f"filter: the table has no field id {term['id']}")
            return name
        if isinstance(term.get("term"), str):  # a reference as some clients wrap it
            return term["term"]
    if isinstance(term, dict) and term.get("type") in ("transform", "apply"):
        return None
    raise PlanRequestError(f"filter: an operand must be a field name, a reference or a function, not {term!r}")


def _is_literal(value: Any) -> bool:
    return not (isinstance(value, dict) and value.get("type") in ("reference", "apply", "transform"))


def _literal(value: Any) -> Any:
    """A literal's value: bare, or ``{"type": "literal", "value": ...}``."""
    if isinstance(value, dict) and value.get("type") == "literal" and "value" in value:
        value = value["value"]
    if value is None or isinstance(value, dict | list):
        raise PlanRequestError(f"filter: a literal must be a single value, not {value!r}")
    return value


def _literals(values: Any, kind: str) -> list:
    if isinstance(values, dict) and values.get("type") == "literals":
        values = values.get("values")
    if not isinstance(values, list) or not values:
        raise PlanRequestError(f"filter: an {kind} predicate needs a list of values")
    return [_literal(v) for v in values]


def bind_request(metadata, request: ScanRequest) -> Any:
    """The schema the request is planned against (the snapshot's with ``use-snapshot-schema``),
    after checking that its filter binds to it and its select and stats fields are in it."""
    from pyiceberg.expressions.visitors import bind

    schema = metadata.schema()
    snapshot = metadata.snapshot_by_id(request.snapshot_id) if request.snapshot_id is not None else None
    if request.use_snapshot_schema and snapshot is not None and snapshot.schema_id is not None:
        schema = next((s for s in metadata.schemas if s.schema_id == snapshot.schema_id), schema)
    for key, names in (("select", request.select), ("stats-fields", request.stats_fields)):
        for name in names or ():
            if name != "*" and _find(schema, name, request.case_sensitive) is None:
                raise PlanRequestError(f"{key}: the table has no field {name!r}")
    try:
        bind(schema, request.row_filter(schema), request.case_sensitive)
    except PlanRequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - PyIceberg's binding raises ValueError, TypeError and its own
        raise PlanRequestError(f"filter: {(str(exc).splitlines() or [type(exc).__name__])[0]}") from None
    return schema


def _find(schema, name, case_sensitive):
    try:
        return schema.find_field(name, case_sensitive)
    except ValueError:
        return None


def data_manifests(metadata, snapshot, io, cache: ManifestCache | None = None) -> tuple[list, list]:
    """The snapshot's data manifests and delete manifests (its manifest list, in order)."""
    from pyiceberg.manifest import ManifestContent

    manifests = cache.manifests(snapshot, io) if cache is not None else snapshot.manifests(io)
    return (
        [m for m in manifests if m.content == ManifestContent.DATA],
        [m for m in manifests if m.content != ManifestContent.DATA],
    )


class ManifestCache:
    """The decoded entries of manifests (live ones: added and existing), by path, for every plan
    a server process makes; at most ``max_entries`` entries, the least recently used manifests
    dropped first (a manifest larger than that is read and not kept). Thread-safe: plans run in
    the thread pool, and read manifests in parallel."""

    def __init__(self, max_entries: int = CACHED_ENTRIES, max_lists: int = CACHED_LISTS) -> None:
        import cachetools

        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._items: cachetools.LRUCache[str, tuple] = cachetools.LRUCache(maxsize=max_entries, getsizeof=len)
        self._lists: cachetools.LRUCache[str, tuple] = cachetools.LRUCache(maxsize=max_lists)
        self.hits = self.misses = 0

    @property
    def entries(self) -> int:
        return int(self._items.currsize)

    def manifests(self, snapshot, io) -> tuple:
        """A snapshot's manifest list (PyIceberg reads it again on every call)."""
        path = snapshot.manifest_list
        with self._lock:
            found = self._lists.get(path)
        if found is not None:
            return found
        read = tuple(snapshot.manifests(io))
        with self._lock:
            self._lists[path] = read
        return read

    def get(self, manifest, io) -> tuple:
        path = manifest.manifest_path
        with self._lock:
            found = self._items.get(path)
            if found is not None:
                self.hits += 1
                return found
            self.misses += 1
        read = tuple(manifest.fetch_manifest_entry(io, discard_deleted=True))  # outside the lock
        if len(read) <= self.max_entries:
            with self._lock:
                self._items[path] = read
        return read


def _planner(metadata, io, row_filter, case_sensitive: bool, cache: ManifestCache | None):
    """PyIceberg's ManifestGroupPlanner, reading manifests through ``cache`` (its
    ``plan_manifest_entries`` as PyIceberg 0.12 has it, with the entries from the cache)."""
    from pyiceberg.table import ManifestGroupPlanner, _min_sequence_number
    from pyiceberg.typedef import KeyDefaultDict
    from pyiceberg.utils.concurrent import ExecutorFactory

    class Cached(ManifestGroupPlanner):
        def plan_manifest_entries(self, manifests):
            evaluators = KeyDefaultDict(self._build_manifest_evaluator)
            manifests = [m for m in manifests if evaluators[m.partition_spec_id](m)]
            partition: KeyDefaultDict[int, Any] = KeyDefaultDict(
                lambda spec_id: _once_per_value(self._build_partition_evaluator(spec_id))
            )
            metrics = self._build_metrics_evaluator()
            floor = _min_sequence_number(manifests)
            work = [(m, partition[m.partition_spec_id]) for m in manifests if self._check_sequence_number(floor, m)]

            def entries(item):
                manifest, in_partition = item
                return [e for e in cache.get(manifest, self.io) if in_partition(e.data_file) and metrics(e.data_file)]

            return ExecutorFactory.get_or_create().map(entries, work)

    return (Cached if cache is not None else ManifestGroupPlanner)(metadata, io, row_filter, case_sensitive)


def _once_per_value(in_partition):
    """``in_partition`` evaluated once per partition value in a plan (the files of a partition,
    across every manifest, share one; a dict's reads and writes are safe across threads)."""
    seen: dict = {}

    def check(data_file) -> bool:
        key = data_file.partition
        found = seen.get(key)
        if found is None:
            found = seen[key] = in_partition(data_file)
        return found

    return check


def between(metadata, start_id: int, end_id: int) -> list[int]:
    """The snapshots after ``start_id`` up to ``end_id`` (an incremental scan's), oldest first;
    PlanRequestError unless ``end_id`` descends from ``start_id``."""
    chain, current = [], metadata.snapshot_by_id(end_id)
    while current is not None and current.snapshot_id != start_id:
        chain.append(current.snapshot_id)
        parent = current.parent_snapshot_id
        current = metadata.snapshot_by_id(parent) if parent is not None else None
    if current is None:
        raise PlanRequestError(f"end-snapshot-id {end_id} does not descend from start-snapshot-id {start_id}")
    return chain[::-1]


def runs(data: list) -> list[tuple[int, int]]:
    """``data`` manifests in runs of at most :data:`PLAN_TASK_MANIFESTS` manifests listing at most
    :data:`PLAN_TASK_FILES` files (a larger manifest alone): one plan answer, or one task, each.
    A plan's memory and answer are bounded by a run's, however large the table."""
    found, lo, files = [], 0, 0
    for i, manifest in enumerate(data):
        listed = (manifest.added_files_count or 0) + (manifest.existing_files_count or 0)
        if i > lo and (i - lo >= PLAN_TASK_MANIFESTS or files + listed > PLAN_TASK_FILES):
            found.append((lo, i))
            lo, files = i, 0
        files += listed
    return [*found, (lo, len(data))] if data else []


def manifests_of(metadata, io, snapshot_id: int, start_id: int | None, cache: ManifestCache) -> tuple:
    """What a plan of ``snapshot_id`` reads: (data manifests, delete manifests, the snapshots
    whose added files it returns: None, or from after ``start_id`` on for an incremental plan)."""
    data, deletes = data_manifests(metadata, metadata.snapshot_by_id(snapshot_id), io, cache)
    if start_id is None:
        return data, deletes, None
    return added_since(metadata, data, start_id), deletes, between(metadata, start_id, snapshot_id)


def added_since(metadata, data: list, start_id: int) -> list:
    """Of the end snapshot's data manifests, those written after ``start_id``: no other holds a
    file a later snapshot added (format 1 tables have no sequence numbers: all of them)."""
    start = metadata.snapshot_by_id(start_id)
    if metadata.format_version < 2 or start.sequence_number is None:
        return data
    return [m for m in data if m.sequence_number > start.sequence_number]


def plan_files(
    metadata,
    io,
    schema,
    request: ScanRequest,
    data: list,
    deletes: list,
    added_by=None,
    cache: ManifestCache | None = None,
) -> list:
    """PyIceberg's FileScanTasks of ``data`` manifests, with the delete files of ``deletes``
    that apply (``metadata`` with ``schema`` current: the schema the request binds to);
    ``added_by``: only the data files those snapshots added that are still live (an incremental
    scan: the files the end's cut reads that it did not read at the start); ``cache``:
    the manifests' entries kept from earlier plans."""
    from pyiceberg.manifest import DataFileContent

    if schema.schema_id != metadata.current_schema_id:
        metadata = metadata.model_copy(update={"current_schema_id": schema.schema_id})
    planner = _planner(metadata, io, request.row_filter(schema), request.case_sensitive, cache)
    wanted = set(added_by) if added_by is not None else None
    equality, sequence = [], {}

    def kept(entry) -> bool:  # a live entry keeps the id of the snapshot that added its file
        content = entry.data_file.content
        if content == DataFileContent.EQUALITY_DELETES:  # PyIceberg 0.12 refuses them: matched below
            equality.append(entry)
            return False
        if content == DataFileContent.DATA:
            sequence[entry.data_file.file_path] = entry.sequence_number
        return wanted is None or content != DataFileContent.DATA or entry.snapshot_id in wanted

    tasks = list(planner.plan_files([*data, *deletes], kept))
    for task in tasks if equality else ():
        task.delete_files |= equality_deletes_of(metadata, task.file, sequence[task.file.file_path], equality)
    if request.min_rows_requested is None:
        return tasks
    enough, rows = [], 0
    for task in tasks:
        if rows >= request.min_rows_requested:
            break
        enough.append(task)
        rows += task.file.record_count if not task.delete_files else 0
    return enough


def equality_deletes_of(metadata, data_file, data_sequence: int, equality: list) -> set:
    """The equality deletes of ``equality`` (manifest entries) that apply to ``data_file``, as
    the spec has it: written after it (a data sequence number strictly greater than the file's)
    and in its partition (the same spec and partition), or in every partition (an unpartitioned
    spec's delete). Statistics prune nothing: a delete that matches no row of the file removes
    none, and the client applies what it is given."""
    specs = metadata.specs()
    return {
        e.data_file
        for e in equality
        if e.sequence_number > data_sequence
        and (
            specs[e.data_file.spec_id].is_unpartitioned()
            or (e.data_file.spec_id == data_file.spec_id and e.data_file.partition == data_file.partition)
        )
    }


def scan_tasks_json(tasks: list, metadata, schema, request: ScanRequest) -> dict:
    """``file-scan-tasks`` and ``delete-files`` (each task naming its deletes by index), the
    spec's ContentFile JSON; statistics only of the ``stats-fields`` asked for."""
    stats_ids = None
    if request.stats_fields is not None:
        stats_ids = {_find(schema, name, request.case_sensitive).field_id for name in request.stats_fields}
    deletes: dict[str, int] = {}
    delete_files: list[dict] = []
    out = []
    for task in tasks:
        refs = []
        for delete in sorted(task.delete_files, key=lambda d: d.file_path):
            if delete.file_path not in deletes:
                deletes[delete.file_path] = len(delete_files)
                delete_files.append(content_file(delete, metadata, schema, None))
            refs.append(deletes[delete.file_path])
        entry: dict = {"data-file": content_file(task.file, metadata, schema, stats_ids)}
        if refs:
            entry["delete-file-references"] = refs
        if request.filter_json is not None:
            entry["residual-filter"] = request.filter_json
        out.append(entry)
    body: dict = {"file-scan-tasks": out}
    if delete_files:
        body["delete-files"] = delete_files
    return body


def content_file(data_file, metadata, schema, stats_ids: set[int] | None) -> dict:
    """A DataFile as the spec's ContentFile (DataFile, PositionDeleteFile or EqualityDeleteFile)."""
    from pyiceberg.conversions import from_bytes, to_json

    spec = metadata.specs()[data_file.spec_id]
    partition_type = spec.partition_type(schema)
    partition = [
        None if value is None else to_json(field.field_type, value)
        for field, value in zip(partition_type.fields, data_file.partition, strict=False)
    ]
    out: dict = {
        "spec-id": data_file.spec_id,
        "partition": partition,
        "content": _CONTENT[int(data_file.content)],
        "file-path": data_file.file_path,
        "file-format": str(data_file.file_format.value).lower(),
        "file-size-in-bytes": data_file.file_size_in_bytes,
        "record-count": data_file.record_count,
    }
    if data_file.split_offsets:
        out["split-offsets"] = list(data_file.split_offsets)
    if data_file.sort_order_id is not None:
        out["sort-order-id"] = data_file.sort_order_id
    if data_file.equality_ids:
        out["equality-ids"] = list(data_file.equality_ids)
    if stats_ids:
        for key, counts in (
            ("column-sizes", data_file.column_sizes),
            ("value-counts", data_file.value_counts),
            ("null-value-counts", data_file.null_value_counts),
            ("nan-value-counts", data_file.nan_value_counts),
        ):
            kept = {k: v for k, v in (counts or {}).items() if k in stats_ids}
            if kept:
                out[key] = {"keys": list(kept), "values": list(kept.values())}
        for key, bounds in (("lower-bounds", data_file.lower_bounds), ("upper-bounds", data_file.upper_bounds)):
            kept = {}
            for field_id, raw in (bounds or {}).items():
                field = schema.find_field(field_id) if field_id in stats_ids else None
                if field is not None and field.field_type.is_primitive:
                    kept[field_id] = to_json(field.field_type, from_bytes(field.field_type, raw))
            if kept:
                out[key] = {"keys": list(kept), "values": list(kept.values())}
    return out
