"""``icebarrier maintain``: the maintenance service (DESIGN.md, "The lake maintains itself").

One per control plane (a Postgres advisory lock on a connection of its own, like the schedule;
a second one waits and takes over). Every few seconds it looks at each table whose snapshot
changed, or whose time came, and runs what the table's policy says is due, in this order:

- **expire**: snapshots past the retention (older than ``retain`` and not among the newest
  ``retain_last``) and outside the protected set (leases, job progress, the read-committed
  window, tags, staged sessions), and the files only they used (lease-aware, as ``expire``);
- **compact**: small data files into files of the target size (Spark ``rewrite_data_files``); the
  snapshot keeps the barrier of the snapshot it rewrote, so cuts stay valid and readers
  downstream skip it. Not while the table holds a commit its job has not completed, nor while a
  job session's commit is staged on it; a pipeline commit that lands first wins (Iceberg's own
  validation fails the rewrite, which gives way and tries again at its next look);
- **rewrite-manifests**: when the current snapshot has more manifests with live files than the
  policy allows (Spark ``rewrite_manifests``), kept barrier like a compaction; after a
  compaction only if still due (it rewrites manifests too);
- **remove-orphans**: files nothing references, data files after ``orphan_grace``, what is under
  the metadata folder (metadata files beyond ``write.metadata.previous-versions-max``, manifests
  and manifest lists of replaced and given-up commits) after ``metadata_grace``. The metadata
  folder is listed every tenth of ``metadata_grace`` (a table committing every second piles up
  ~100 files a minute there, so it holds at most a tenth more than a grace's worth), the whole
  location every half ``metadata_grace``; a minute apart at least. The manifests' data files
  are read once per worker (a manifest never changes). Each pass counts what it listed: it logs
  the count and ``table_maintenance`` (so ``/metrics`` and ``table show``) holds the last one.

Each action is recorded (``table_maintenance``, the audit trail, ``/metrics``) when it did
something, gave way or failed; a failure is logged and the service goes on with the next table.
An orphan removal that found nothing to remove is logged (with its count), not recorded.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime

import cachetools

from icebarrier.control_plane import db, tables, upkeep
from icebarrier.control_plane.db import Conn
from icebarrier.control_plane.errors import IcebarrierError
from icebarrier.control_plane.fences import Fence
from icebarrier.control_plane.model import TableName
from icebarrier.control_plane.upkeep import Policy
from icebarrier.iceberg_ext import maintenance, orphans
from icebarrier.iceberg_ext.catalog import load_table, lost_race, outages
from icebarrier.iceberg_ext.catalog import pointers as catalog_pointers
from icebarrier.iceberg_ext.config import Settings
from icebarrier.iceberg_ext.errors import CompactionDeferredError
from icebarrier.iceberg_ext.upkeep import Looker, due

MIN_ORPHAN_EVERY_S = 60.0
MANIFESTS_CACHED = 200_000  # data-file paths of manifests a worker keeps for its expiries and orphan passes
# A table without commits is looked at again this long after its last look (its protected
# snapshots may have been released meanwhile), or when a snapshot passes its retention.
IDLE_LOOK_S = 300.0
RETRY_S = 1.0  # after the control plane was unreachable
REWRITES = ("compact", "rewrite-manifests")  # the actions that change the current snapshot's files


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """One action the service ran on a table."""

    table: TableName
    action: str
    result: str  # done, gave-way, failed
    detail: dict

    def line(self) -> str:
        what = ", ".join(f"{k} {v}" for k, v in self.detail.items() if not isinstance(v, list | dict))
        return f"table {self.table}: {self.action} {self.result}" + (f" ({what})" if what else "")


@dataclass(slots=True)
class _Table:
    pointer: str | None = None  # the metadata location at its last look
    policy: Policy | None = None
    look_at: float = 0.0  # time.time() of its next look even without a commit
    orphans_at: float = 0.0  # the next orphan pass (of the metadata folder at least)
    sweep_at: float = 0.0  # the next orphan pass over the whole location
    said: dict[str, str] = field(default_factory=dict)  # action -> the last give-way reason recorded
    gave_way: bool = False  # at its last look an action gave way: look again at the next tick
    moved_at: float | None = None  # when the service first saw its pointer move since its last look
    files: upkeep.Files | None = None  # what an orphan removal at this look counted

    def due_since(self, now: float) -> float:
        """Since when a look at it is due (the order of need: the longest due first)."""
        return min(self.moved_at if self.moved_at is not None else now, self.look_at)


@dataclass
class Maintainer:
    """The service's loop (``run``) and one pass over the tables (``maintain``)."""

    settings: Settings
    tick_s: float = 5.0
    log: Callable[[str], None] = print
    spark_factory: Callable[[], object] | None = None  # a SparkSession, started at the first compaction
    only: frozenset[TableName] | None = None  # these tables only (default: every table of the catalog)
    _tables: dict[TableName, _Table] = field(default_factory=dict)
    _looker: Looker = field(default_factory=Looker)
    _unmanaged: frozenset[TableName] | None = None  # the catalog's tables no job writes, as last enrolled
    _keys: frozenset[TableName] | None = None  # the catalog's tables at the last pass
    _marks: upkeep.Marks | None = None  # the policies' and managed tables' marks at the last pass
    workers: int = 1  # tables looked at (and maintained) at a time
    _pool: _Workers | None = None
    _spark: object | None = None
    _spark_lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _manifests: threading.local = field(default_factory=threading.local)  # a worker's manifests' files

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Wait for the service's lock, then maintain until stopped, waiting again whenever the
        lock's connection is lost."""
        fence = Fence(
            "maintenance", "maintenance_state", dsn=self.settings.dsn, schema=self.settings.schema, log=self.log
        )
        while fence.acquire(self._stop):
            self.log(
                f"maintain: running ({fence.holder}); a look every {self.tick_s:g}s"
                + (f", {self.workers} tables at a time" if self.workers > 1 else "")
            )
            try:
                with db.connect(self.settings.dsn, self.settings.schema, actor="maintain") as conn, self._workers():
                    self._maintain_while_held(fence, conn, self._catalog())
            except outages() as exc:  # a restart, a failover: the lock's connection may have outlived it
                self.log(f"maintain: control plane unreachable ({str(exc).splitlines()[0]}); trying again")
                self._stop.wait(RETRY_S)
            finally:
                fence.release()

    def once(self, conn: Conn, catalog) -> list[Action]:
        """One pass (no lock: for cron or a test), with the workers."""
        with self._workers():
            return self.maintain(conn, catalog)

    @contextmanager
    def _workers(self):
        self._pool = _Workers(self.settings, self.workers, self._catalog) if self.workers > 1 else None
        try:
            yield
        finally:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def _maintain_while_held(self, fence: Fence, conn: Conn, catalog) -> None:
        while not self._stop.is_set():
            if not fence.alive():
                self.log("maintain: lost the service's lock (its connection broke); waiting for it again")
                return
            for action in self.maintain(conn, catalog, may_act=fence.valid):
                self.log(action.line())
            fence.publish([])
            self._stop.wait(self.tick_s)

    def _catalog(self):
        from icebarrier.iceberg_ext.catalog import load_catalog

        return load_catalog(self.settings)

    # one pass

    def maintain(
        self, conn: Conn, catalog, *, now: float | None = None, may_act: Callable[[], bool] | None = None
    ) -> list[Action]:
        """Look at each table that changed or whose time came, the longest due first; run what is
        due. Returns what ran. ``may_act``: asked before each table's actions (the service's
        lease); False ends the pass. With ``workers`` above one, that many tables at a time."""
        now = now or time.time()
        pointers = catalog_pointers(conn, self.settings)  # every table of the catalog, managed or not
        if self.only is not None:
            pointers = {name: p for name, p in pointers.items() if name in self.only}
        todo = self._due(conn, pointers, now)

        def look(status: upkeep.Status, conn: Conn, catalog) -> list[Action] | None:
            return self._look(conn, catalog, status, pointers[status.policy.table], now, may_act)

        if self._pool is None:
            done: list[Action] = []
            for status in todo:
                ran = look(status, conn, catalog)
                if ran is None:
                    break  # stopped, or the lease lapsed: another instance may hold the service now
                done += ran
            return done
        return [a for ran in self._pool.map(lambda s: self._pool.run(look, s), todo) if ran for a in ran]

    def _due(self, conn: Conn, pointers: dict[TableName, str], now: float) -> list[upkeep.Status]:
        """The statuses of the tables to look at, the longest due first. What a pass reads grows
        with what changed, not with the lake: a table's status is read when its pointer moved or
        its time came (or for every table when a policy changed, which one count tells)."""
        marks = upkeep.marks(conn)
        keys = frozenset(pointers)
        if (
            self._marks is None or keys != self._keys or marks.managed != self._marks.managed
        ):  # created, dropped, (un)managed
            unmanaged = keys - tables.managed_names(conn)
            if unmanaged != self._unmanaged:
                upkeep.enroll_unmanaged(conn, sorted(unmanaged))
                self._unmanaged = unmanaged
            self._keys = keys
        if marks != self._marks:
            statuses = upkeep.statuses(conn)
        else:
            changed = [
                name
                for name, pointer in pointers.items()
                if (state := self._tables.get(name)) is None or state.pointer != pointer or now >= state.look_at
            ]
            statuses = upkeep.statuses(conn, changed) if changed else []
        self._marks = marks
        todo = []
        for status in statuses:
            policy, name = status.policy, status.policy.table
            pointer = pointers.get(name)
            if pointer is None:
                continue  # not created yet
            state = self._tables.setdefault(name, self._first(status, now))
            if not policy.enabled:  # off: read again when a policy changes (or its idle look comes)
                state.pointer, state.policy, state.look_at = pointer, policy, now + IDLE_LOOK_S
                continue
            if state.pointer == pointer and state.policy == policy and now < state.look_at:
                continue
            if state.pointer != pointer and state.moved_at is None:
                state.moved_at = now
            todo.append(status)
        return sorted(todo, key=lambda st: self._tables[st.policy.table].due_since(now))

    def _look(
        self,
        conn: Conn,
        catalog,
        status: upkeep.Status,
        pointer: str,
        now: float,
        may_act: Callable[[], bool] | None,
    ) -> list[Action] | None:
        """Look at one table and run what is due. None: the pass ends here (stopped, or the
        lease lapsed)."""
        if self._stop.is_set():
            return None  # stopped: after the action in flight, not after the whole pass
        policy, name = status.policy, status.policy.table
        state = self._tables[name]
        try:
            tbl = load_table(catalog, name)
        except Exception as exc:  # noqa: BLE001 - a table dropped or unreadable: say so, go on
            self.log(f"table {name}: cannot be loaded ({str(exc).splitlines()[0]}); skipped this pass")
            return []
        if tbl.current_snapshot() is None:  # nothing committed yet: look again when something is
            state.pointer, state.policy, state.look_at, state.moved_at = pointer, policy, now + IDLE_LOOK_S, None
            return []
        seen = self._looker.look(tbl, policy)
        actions, _ = due(seen, policy, orphans_at=state.orphans_at, now=now)
        if actions and may_act is not None and not may_act():
            return None
        state.gave_way = False
        sweep = now >= state.sweep_at
        ran: list[Action] = []
        rewritten = False  # the current snapshot's files changed since ``seen``
        stale = False  # the table changed since ``seen``
        for x in actions:
            if rewritten:
                seen, rewritten, stale = self._looker.look(load_table(catalog, name), policy), False, False
                if x not in due(seen, policy, orphans_at=state.orphans_at, now=now)[0]:
                    continue  # a compaction rewrites manifests too: most often none are left to rewrite
            a = self._run(conn, catalog, name, policy, x, sweep)
            if a is not None:
                ran.append(a)
                rewritten = a.action in REWRITES and a.result == "done"
                stale = stale or (a.result == "done" and a.action != "remove-orphans")
        if stale:  # what the next look is due on, as the actions left the table
            seen = self._looker.look(load_table(catalog, name), policy)
        if "remove-orphans" in actions:
            if sweep:
                state.sweep_at = now + _sweep_every_s(policy)
            state.orphans_at = min(now + _orphans_every_s(policy), state.sweep_at)
        _, next_ = due(seen, policy, orphans_at=state.orphans_at, now=now)
        files, state.files = state.files, None
        upkeep.observe(conn, name, seen.to_json(), next_, files)
        state.pointer, state.policy, state.moved_at = pointer, policy, None
        wake = [state.orphans_at, now + IDLE_LOOK_S]
        if seen.expirable_at_ms is not None:
            wake.append(seen.expirable_at_ms / 1000)
        if state.gave_way:
            wake.append(now + self.tick_s)
        state.look_at = min(wake)
        return ran

    def _first(self, status: upkeep.Status, now: float) -> _Table:
        """A table's state at the service's start: its orphan passes are due as
        :func:`_orphans_every_s` and :func:`_sweep_every_s` say after the last one recorded (another
        service's too), or now."""
        last = status.actions.get("remove-orphans")
        if last is None:
            return _Table(orphans_at=now, sweep_at=now)
        at = datetime.fromisoformat(last["at"]).timestamp()
        sweep_at = at + _sweep_every_s(status.policy)
        return _Table(orphans_at=min(at + _orphans_every_s(status.policy), sweep_at), sweep_at=sweep_at)

    def _run(
        self,
        conn: Conn,
        catalog,
        name: TableName,
        policy: Policy,
        action: str,
        sweep: bool,
    ) -> Action | None:
        state = self._tables[name]
        started = time.perf_counter()
        try:
            detail = self._act(conn, catalog, name, policy, action, sweep)
            result = "done"
        except CompactionDeferredError as exc:
            state.gave_way = True
            if state.said.get(action) == str(exc):
                return None  # said once: not again at every look while it lasts
            result, detail = "gave-way", {"why": str(exc)}
        except IcebarrierError as exc:
            result, detail = "failed", {"why": str(exc)}
        except Exception as exc:  # noqa: BLE001 - Spark's and Iceberg's own (a lost race): a retry comes
            why = _why(exc)
            result = "gave-way" if lost_race(exc) else "failed"
            state.gave_way = state.gave_way or result == "gave-way"
            detail = {"why": why[:500]}
        if detail is None:
            return None  # nothing to do after all
        detail["seconds"] = round(time.perf_counter() - started, 2)  # what it cost: an operator sees it
        if action == "remove-orphans" and result == "done" and not detail["deleted"]:
            self.log(Action(table=name, action=action, result=result, detail=detail).line())
            return None  # a count of the files, not an action: logged, not recorded
        state.said[action] = detail.get("why", "")
        upkeep.record(conn, name, action, result, detail)
        return Action(table=name, action=action, result=result, detail=detail)

    def _act(self, conn, catalog, name, policy: Policy, action: str, sweep: bool) -> dict | None:
        if action == "expire":
            report = maintenance.expire(
                conn,
                catalog,
                name,
                older_than_s=policy.retain_s,
                retain_last=policy.retain_last,
                manifests=self._manifests_read(),
            )
            if not report.expired:
                return None
            return {
                "expired": len(report.expired),
                "kept": len(report.protected),
                "files_deleted": report.files_deleted,
            }
        if action == "remove-orphans":
            removed = orphans.remove_orphans(
                conn,
                catalog,
                name,
                older_than_s=policy.orphan_grace_s,
                metadata_older_than_s=policy.metadata_grace_s,
                catalog_schema=self.settings.catalog_schema,
                metadata_only=not sweep,
                manifests=self._manifests_read(),
            )
            self._tables[name].files = upkeep.Files(metadata=removed.metadata_files, data=removed.data_files)
            detail = {
                "deleted": len(removed.orphans),
                "kept_recent": removed.kept_recent,
                "metadata_files": removed.metadata_files,
                **({"data_files": removed.data_files} if removed.data_files is not None else {}),
            }
            return detail
        manifests = action == "rewrite-manifests"
        report = maintenance.compact(
            self._spark_session(),
            conn,
            catalog,
            name,
            min_input_files=policy.compact_min_files,
            target_file_size=policy.target_file_size,
            manifests=manifests,
        )
        if report.snapshot_id is None:
            return None
        return {"barrier": report.barrier, "snapshot_id": report.snapshot_id, "rewritten": report.rewritten_files}

    def _manifests_read(self) -> cachetools.LRUCache:
        """This worker's data files of the manifests its expiries and orphan passes read (each
        worker thread has its own: the cache is not thread-safe), bounded in paths held."""
        if not hasattr(self._manifests, "cache"):
            self._manifests.cache = cachetools.LRUCache(maxsize=MANIFESTS_CACHED, getsizeof=len)
        return self._manifests.cache

    def _spark_session(self):
        with self._spark_lock:  # workers: one session, started once
            return self._started_spark()

    def _started_spark(self):
        if self._spark is None:
            if self.spark_factory is None:
                from icebarrier.iceberg_ext.spark import spark_session

                self.log("maintain: starting Spark for compaction (once; it stays up)")
                self._spark = spark_session(self.settings, app_name="icebarrier-maintain", master="local[1]")
            else:
                self._spark = self.spark_factory()
        return self._spark


class _Workers:
    """Threads that look at tables at the same time, each with a control-plane connection and a
    catalog of its own (one Spark session serves them all: it takes jobs from many threads)."""

    def __init__(self, settings: Settings, n: int, catalog: Callable[[], object]) -> None:
        self._executor = ThreadPoolExecutor(max_workers=n, thread_name_prefix="maintain")
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._conns = [db.connect(settings.dsn, settings.schema, actor="maintain") for _ in range(n)]
        for conn in self._conns:
            self._idle.put((conn, catalog()))

    def map(self, fn, items):
        return self._executor.map(fn, items)

    def run(self, fn, item):
        conn, catalog = self._idle.get()
        try:
            return fn(item, conn, catalog)
        finally:
            self._idle.put((conn, catalog))

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        for conn in self._conns:
            conn.close()


def _orphans_every_s(policy: Policy) -> float:
    """How often a table's metadata folder is listed for orphans: every tenth of its grace."""
    return max(MIN_ORPHAN_EVERY_S, policy.metadata_grace_s / 10)


def _sweep_every_s(policy: Policy) -> float:
    """How often a table's whole location is listed for orphans: every half its metadata grace."""
    return max(MIN_ORPHAN_EVERY_S, policy.metadata_grace_s / 2)


def _why(exc: Exception) -> str:
    """An exception in one line: a Java one's own message (py4j's first line names only the call)."""
    java = getattr(exc, "java_exception", None)
    text = str(java.toString()) if java is not None else str(exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
