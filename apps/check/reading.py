"""The run's readers: reads at every level (through the control plane and through the catalog
server), repeatable-read sessions compared with their first read, and the validation of every
barrier's cut against the model (a part of the run, :class:`~.driver._Run`)."""

from __future__ import annotations

import time

from icebarrier.apps.check.exec_jobs import QUIET_S
from icebarrier.apps.check.model import SCHEMAS, check_cut, compare
from icebarrier.apps.check.processes import barrier_number
from icebarrier.control_plane import leases, tokens
from icebarrier.control_plane.errors import (
    BarrierNotValidError,
    NoValidCutError,
    SnapshotExpiredError,
)
from icebarrier.control_plane.model import Level
from icebarrier.iceberg_ext.errors import LeaseLostError
from icebarrier.iceberg_ext.reads import ConsistentRead

RR_TTL_S = 2.0  # short: repeatable-read sessions outlive it, so renewal is exercised


class Reading:
    """The run's reads and validation (mixed into the run: its connections, report and model)."""

    def catalog_read(self, warehouse: str) -> dict | None:
        """Every table as the catalog serves it through ``warehouse`` (one session), every other
        read planned on the server (its scan planning, at the warehouse's cut); None if the
        server was down or answered 503 (the schedule killed it, or Postgres restarted), or a
        read-committed session's loads came slower than its quiet window (it may have moved)."""
        import requests
        from pyiceberg.catalog.rest import RestCatalog
        from pyiceberg.exceptions import ServiceUnavailableError

        if self.catalog_server.down_until is not None:
            self.report.catalog_unavailable += 1
            return None
        credential = self.credentials["reader"]
        if warehouse == "read-committed":  # an independent reader: a client (token) of its own, so a moment of its own
            credential = ":".join(
                self.cp.run(
                    "token", lambda conn: tokens.create(conn, name="check read-committed reader", whole_lake=True)
                )
            )
        planned = (self.report.catalog_reads + self.report.catalog_validated) % 2 == 1  # every other read
        # a reader token is vended the run's [storage.readers] keys; without them it brings its own
        # (docs/storage.md). Never none: S3 refuses an anonymous read of a private object (moto only
        # of objects with an ACL, as Spark's compactions write them: a run with --maintain found it)
        own = {} if self.env.readers else self.env.storage
        try:
            catalog = RestCatalog(
                f"check-{warehouse}",
                uri=self.catalog_server.uri,
                warehouse=warehouse,
                credential=credential,
                **{"scan-planning-mode": "server" if planned else "client", **own},
            )
            tables, previous = {}, None
            for name in SCHEMAS:
                began = time.monotonic()
                tables[name] = catalog.load_table(f"{self.env.ns}.{name}")
                # The server takes a load's moment somewhere inside it: two loads' moments are at
                # most (this one's end - the previous one's start) apart. Past --session-quiet, the
                # session may have moved to a newer cut between them.
                if warehouse == "read-committed" and previous is not None and time.monotonic() - previous >= QUIET_S:
                    self.report.excused["catalog read-committed: loads slower than the session's quiet"] += 1
                    return None
                previous = began
            read = {name: table.scan().to_arrow() for name, table in tables.items()}
            self.report.catalog_planned += planned
            return read
        except (requests.ConnectionError, ServiceUnavailableError):
            self.report.catalog_unavailable += 1
            return None

    # -- reads

    def read_levels(self) -> None:
        for level in (Level.READ_UNCOMMITTED, Level.READ_COMMITTED):
            try:
                cut, data = self.cp.run(f"read {level.value}", lambda conn: self._read(conn, level))
            except NoValidCutError:
                self.report.no_valid_cut += 1
                continue
            except Exception as exc:  # noqa: BLE001 - classified below
                if level is Level.READ_UNCOMMITTED:
                    self.report.read_uncommitted_errors += 1  # no protection at this level: expected
                    continue
                self.report.reads[level.value] += 1
                self.report.anomaly(level, f"read failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            self.report.reads[level.value] += 1
            problem = check_cut(data)
            if level is Level.READ_COMMITTED:  # a valid cut holds exactly the model's rows at its barrier
                problem = problem or compare(self.env.seed, self._number(cut.barrier), data)
            if problem:
                self.report.anomaly(level, problem)
        if self.catalog_server is not None and self.rng.random() < 0.3:  # a catalog read costs ~10 requests
            self.catalog_read_committed()

    def catalog_read_committed(self) -> None:
        """A read-committed read through the catalog server: the invariants hold across its tables."""
        try:
            data = self.catalog_read("read-committed")
        except FileNotFoundError:
            self.report.excused["catalog read-committed: files expired mid-scan"] += 1
            return
        except Exception as exc:  # noqa: BLE001 - an error reading a valid cut is an anomaly
            self.report.catalog_reads += 1
            self.report.catalog_anomalies += 1
            self.report.examples.setdefault("catalog read-committed", f"{type(exc).__name__}: {str(exc)[:200]}")
            return
        if data is None:
            return
        self.report.catalog_reads += 1
        problem = check_cut(data)
        if problem:
            self.report.catalog_anomalies += 1
            self.report.examples.setdefault("catalog read-committed", problem)

    def _read(self, conn, level: Level):
        with ConsistentRead(conn, self.catalog, self.names, level=level, holder="check") as r:
            cut, data = r.read()
        return cut, {t.name: d for t, d in data.items()}

    def repeatable_read(self) -> None:
        """Open a session now and then; re-read it; close it now and then."""
        if self.rr is None:
            if self.rng.random() >= 0.2:
                return
            try:
                self.rr = self.cp.run(
                    "rr open",
                    lambda conn: ConsistentRead(
                        conn,
                        self.catalog,
                        self.names,
                        level=Level.REPEATABLE_READ,
                        ttl_s=RR_TTL_S,
                        holder="check-session",
                    ).__enter__(),
                )
            except NoValidCutError:
                self.report.no_valid_cut += 1
                return
            except SnapshotExpiredError:
                self.report.leases_refused += 1
                return
            self.report.rr_sessions += 1
            self.rr_first = self._rr_read()
            return
        if self.rr_first is not None:
            again = self._rr_read()
            if again is not None and again != self.rr_first:
                self.report.anomaly(Level.REPEATABLE_READ, "a repeatable-read session saw its rows change")
        if self.rr is not None and self.rng.random() < 0.15:
            self.close_rr()

    def _rr_read(self):
        self.report.reads["repeatable-read"] += 1
        try:
            cut, data = self._with_connection_retry(self.rr.read)
        except LeaseLostError:
            self.report.leases_lost += 1  # the read stopped instead of reading unprotected
            self.close_rr()
            return None
        except Exception as exc:  # noqa: BLE001
            self.report.anomaly(Level.REPEATABLE_READ, f"read failed: {type(exc).__name__}: {str(exc)[:200]}")
            self.close_rr()
            return None
        data = {t.name: d for t, d in data.items()}
        problem = check_cut(data) or compare(self.env.seed, self._number(cut.barrier), data)
        if problem:
            self.report.anomaly(Level.REPEATABLE_READ, problem)
        return {t: sorted(map(tuple, (tuple(r.values()) for r in d.to_pylist()))) for t, d in data.items()}

    def close_rr(self) -> None:
        if self.rr is not None:
            self.report.leases_renewed += self.rr.lease_renewals
            try:
                self._with_connection_retry(lambda: self.rr.__exit__(None, None, None))
            except Exception:  # noqa: BLE001 - an unrenewable lease lapses on its own
                pass
            self.rr, self.rr_first = None, None

    def _with_connection_retry(self, fn):
        return self.cp.run("read", lambda _conn: fn())

    def _number(self, barrier: int) -> int:
        return self.cp.run("barrier number", lambda conn: barrier_number(conn, barrier))

    # -- history

    def validate_new(self, upto: int | None = None) -> None:
        """Validate, in order, every barrier the pinner queued (with ``upto``: after pinning, here,
        every barrier up to it), releasing its pin."""
        if upto is not None:
            self.pinner.pin_new(upto)
        self.pinner.raise_error()
        while not self.pinner.queue.empty():
            barrier, anchor, number, lease_id = self.pinner.queue.get()
            try:
                self._validate(barrier, number, anchor=anchor)
            finally:
                if lease_id is not None:
                    self.cp.run("unpin", lambda conn: leases.release(conn, lease_id))

    def _validate(self, barrier: int, number: int, *, anchor: bool) -> None:
        def read(conn):
            with ConsistentRead(
                conn,
                self.catalog,
                self.names,
                level=Level.REPEATABLE_READ,
                barrier=barrier,
                ttl_s=60,
                holder="check-validator",
            ) as r:
                return r.read()[1]

        try:
            data = {t.name: d for t, d in self.cp.run("validate", read).items()}
        except SnapshotExpiredError:
            self.report.excused["expired before validation"] += 1
            return
        except BarrierNotValidError as exc:
            coalesced = any("coalesced" in why for why in exc.reasons.values())
            if coalesced and anchor:
                self._violation(f"anchor #{number} was refused: {exc}")
            elif coalesced:
                self.report.coalesced_refused += 1
                self.report.excused["coalesced"] += 1
            else:
                self.report.excused["before every job started"] += 1
            return
        except Exception as exc:  # noqa: BLE001 - a pinned cut that cannot be read is damage to report
            self._violation(f"cut at barrier #{number} could not be read: {type(exc).__name__}: {str(exc)[:200]}")
            return
        self.report.validated += 1
        self.report.anchors_validated += anchor
        self.accepted[barrier] = number
        problem = compare(self.env.seed, number, data) or check_cut(data)
        if problem:
            self.report.violations.append(f"cut at barrier #{number}: {problem}")
        if self.catalog_server is not None:  # the same cut through the catalog's barrier-<B> warehouse
            try:
                served = self.catalog_read(f"barrier-{barrier}")
            except Exception as exc:  # noqa: BLE001 - a pinned cut the catalog cannot serve is damage
                self._violation(f"cut at barrier #{number} through the catalog: {type(exc).__name__}: {str(exc)[:200]}")
                return
            if served is not None:
                self.report.catalog_validated += 1
                problem = compare(self.env.seed, number, served) or check_cut(served)
                if problem:
                    self._violation(f"cut at barrier #{number} through the catalog: {problem}")
