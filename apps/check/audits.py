"""The run's audits, independent of the control plane's own records: pins (no protected
snapshot missing), commits (each barrier's snapshot is the recorded one, none written twice),
job inputs and publishes (a part of the run, :class:`~.driver._Run`)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from icebarrier.apps.check.model import DERIVED, ROOTS, events
from icebarrier.control_plane import delays, leases
from icebarrier.iceberg_ext.catalog import (
    SUMMARY_BARRIER,
    SUMMARY_RUN,
    coalesced_after,
    is_compaction,
    lineage,
    load_table,
    summary_properties,
)


class Audits:
    """The run's audits (mixed into the run: its connections, report and tables)."""

    # -- audits

    def audit_pins(self) -> None:
        """No snapshot protected (by a lease, job progress, the read window or as current)
        before and after loading a table's metadata is missing from it."""
        for table in self.names:

            def audit(conn):
                before = leases.protected(conn, table)
                present = {s.snapshot_id for s in load_table(self.catalog, table).metadata.snapshots}
                after = leases.protected(conn, table)
                return [
                    (sid, sorted(set(before[sid].reasons) | set(after[sid].reasons)))
                    for sid in before.keys() & after.keys()
                    if sid not in present
                ]

            for sid, reasons in self.cp.run("audit pins", audit):
                violation = f"snapshot {sid} of {table} is protected ({', '.join(reasons)}) but was expired"
                if violation not in self.report.violations:
                    self.report.violations.append(violation)

    def audit_commits(self, *, final: bool) -> None:
        """In each table's current lineage, the snapshots carrying a barrier come from one run
        (an overwrite is a delete and an append, both tagged) and include the one recorded for
        (table, barrier) as its data (a compaction's record maps the barrier to its rewrite).
        Unrecorded barriers are checked at the end only: a crashed job adopts
        its own snapshot on restart."""
        for table in self.names:
            tbl = load_table(self.catalog, table)
            runs_of, ids_of = defaultdict(set), defaultdict(set)
            for snap in lineage(tbl):
                props = summary_properties(snap)
                if SUMMARY_BARRIER in props and not is_compaction(snap):
                    runs_of[int(props[SUMMARY_BARRIER])].add(props.get(SUMMARY_RUN))
                    ids_of[int(props[SUMMARY_BARRIER])].add(snap.snapshot_id)
                    after = coalesced_after(snap)
                    for b, number in self.accepted.items() if after is not None else ():
                        if after < b < int(props[SUMMARY_BARRIER]):
                            self._violation(
                                f"cut at barrier #{number} was accepted, but {table} coalesced it: its "
                                f"snapshot {snap.snapshot_id} covers barriers {after}.."
                                f"{props[SUMMARY_BARRIER]}"
                            )
            for barrier, runs in runs_of.items():
                if len(runs) > 1:
                    self._violation(
                        f"{table} was written {len(runs)} times for barrier {barrier} "
                        f"(snapshots {sorted(ids_of[barrier])})"
                    )
            if not final:
                continue
            records = self.cp.run(
                "audit commits",
                lambda conn: conn.execute(
                    """SELECT c.barrier, c.snapshot_id,
                          EXISTS (SELECT 1 FROM expired_snapshot e WHERE e.table_id = c.table_id
                                  AND e.snapshot_id = c.snapshot_id) AS expired
                   FROM table_commit c JOIN managed_table m USING (table_id)
                   WHERE m.name = %s AND c.revoked_by IS NULL AND c.operation <> 'compaction'""",
                    (str(table),),
                ).fetchall(),
            )
            recorded = {r["barrier"]: r for r in records}
            present = {s.snapshot_id for s in tbl.metadata.snapshots}
            passed = self.cp.run(
                "completions",
                lambda conn: conn.execute(
                    """SELECT c.from_barrier, c.barrier, c.coalesced FROM table_completion c JOIN managed_table m
                   USING (table_id) WHERE m.name = %s AND c.from_barrier IS NOT NULL""",
                    (str(table),),
                ).fetchall(),
            )
            for barrier, ids in ids_of.items():
                record = recorded.get(barrier)
                inside = [p for p in passed if p["from_barrier"] < barrier < p["barrier"]]
                if record is None and inside:
                    how = "coalesced" if inside[0]["coalesced"] else "skipped"
                    self._violation(
                        f"snapshot(s) {sorted(ids)} of {table} carry barrier {barrier}, which the table "
                        f"{how} ({inside[0]['from_barrier']}..{inside[0]['barrier']}): no computation "
                        f"may write there"
                    )
                elif record is None:
                    self._violation(
                        f"snapshot(s) {sorted(ids)} of {table} carry barrier {barrier} but the control "
                        f"plane has no record of that barrier"
                    )
                elif record["snapshot_id"] not in ids and not record["expired"]:
                    self._violation(
                        f"{table}: barrier {barrier} is recorded as snapshot {record['snapshot_id']}, "
                        f"but the table's lineage has {sorted(ids)} for it"
                    )
            for r in records:
                if r["snapshot_id"] not in present and not r["expired"]:
                    self._violation(
                        f"{table}: the record of barrier {r['barrier']} names snapshot "
                        f"{r['snapshot_id']}, which is neither in the table nor expired"
                    )

    def audit_inputs(self) -> None:
        """Each barrier a root job took input for (its recorded range) and completed has a commit
        record if the model has rows in that range: no (table, barrier) lost from the map."""
        for job, table in ROOTS.items():

            def ranges(conn, job=job, table=table):
                return conn.execute(
                    """SELECT r.barrier, r.spec, c.snapshot_id
                       FROM input_range r JOIN managed_table m ON m.name = %s
                       LEFT JOIN table_commit c ON c.table_id = m.table_id AND c.barrier = r.barrier
                                               AND c.revoked_by IS NULL
                       WHERE r.job_name = %s AND r.barrier <= m.watermark""",
                    (str(self.env.t(table)), job),
                ).fetchall()

            for r in self.cp.run("audit inputs", ranges):
                spec = r["spec"]
                if "offsets" in spec:  # from Kafka (check --kafka): a non-empty range was recorded
                    has_input, what = any(e > s for s, e in spec["offsets"].values()), f"offsets {spec['offsets']}"
                else:
                    has_input = events(self.env.seed, table, spec["t_from"], spec["t_to"]).num_rows > 0
                    what = f"({spec['t_from']}, {spec['t_to']}]"
                if r["snapshot_id"] is None and has_input:
                    self._violation(
                        f"{self.env.t(table)} completed barrier {r['barrier']} with input {what} "
                        f"but has no commit record for it"
                    )

    def audit_publishes(self) -> None:
        """A job exec job's sinks never show a barrier its job has not completed: the catalog
        swaps a session's pointers and completes its barrier in one transaction. Pointer and
        watermark are read in one statement (one snapshot of the database)."""
        from psycopg import sql
        from pyiceberg.io import load_file_io
        from pyiceberg.serializers import FromInputFile

        settings = self.env.settings
        query = sql.SQL(
            "SELECT m.name, m.watermark, t.metadata_location FROM managed_table m JOIN {}.iceberg_tables t "
            "ON t.catalog_name = %s AND t.table_namespace = %s AND m.name = t.catalog_name || '.' || "
            "t.table_namespace || '.' || t.table_name WHERE m.name = ANY(%s)"
        ).format(sql.Identifier(settings.catalog_schema))
        sinks = [str(self.env.t(DERIVED[j][1] if j in DERIVED else ROOTS[j])) for j in sorted(self.exec_jobs)]
        for row in self.cp.run(
            "audit publishes", lambda conn: conn.execute(query, (settings.catalog, self.env.ns, sinks)).fetchall()
        ):
            io = load_file_io(settings.pyiceberg_properties(), row["metadata_location"])
            current = FromInputFile.table_metadata(io.new_input(row["metadata_location"])).current_snapshot()
            shown = int(summary_properties(current).get(SUMMARY_BARRIER, 0)) if current is not None else 0
            if shown > (row["watermark"] or 0):
                self._violation(
                    f"{row['name']} shows barrier {shown} while its job has completed only "
                    f"{row['watermark']}: a session's commits were visible before its barrier completed"
                )

    def audit_refusals(self) -> None:
        """No job exec job's publish was refused because its sink moved under the run: nothing but
        maintenance writes a job's sink, and a pipeline's commit wins a race with maintenance
        (`job exec --follow` survives such a refusal by running the barrier again, so its exits
        alone would not show it)."""
        for job in sorted(self.exec_jobs):
            log = Path(self.env.reports) / f"{job}.log"
            lines = log.read_text().splitlines() if log.exists() else []
            lost = [ln for ln in lines if "was changed outside the barrier staged for it" in ln]
            if lost:
                self._violation(f"job exec {job}: {len(lost)} publish(es) refused, its sink moved under it: {lost[0]}")

    def count_completions(self) -> None:
        """How the jobs completed barriers: one exact barrier, a skipped run, a coalesced range."""
        for kinds in self.cp.run("completions", delays.completion_kinds).values():
            self.report.completions.update(kinds)

    def _violation(self, text: str) -> None:
        if text not in self.report.violations:
            self.report.violations.append(text)
