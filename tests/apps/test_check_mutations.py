"""The checker can fail: a live run corrupted from outside is reported, a clean one passes.

Each test runs the checker in a thread on a fresh database (no restarts, no job faults, so
the corruption is the only thing wrong), corrupts the run from the test's own connections
once it is under way, and asserts that the report names the damage."""

import json
import threading
import time

import psycopg
import pyarrow as pa
import pytest

from icebarrier.apps.check import CheckReport, events, private_env, run_check
from icebarrier.iceberg_ext.catalog import (
    SUMMARY_BARRIER,
    SUMMARY_JOB,
    SUMMARY_RUN,
    load_catalog,
    load_table,
    retry_commit,
    upgrade,
)
from tests.helpers import new_database

pytestmark = pytest.mark.slow
SEED = 5


@pytest.fixture
def live_run(request, pg_server, tmp_path):
    """Start a checker run (10 s, or the test's indirect parameter); yields (env,
    wait_for_barriers, finish, running)."""
    duration_s = getattr(request, "param", 10)
    with new_database(pg_server, "icebarrier_mut") as dsn:
        env = private_env(dsn, tmp_path, SEED)
        upgrade(env.settings)
        report = CheckReport(seed=SEED)
        done: list = []
        thread = threading.Thread(
            target=lambda: done.append(
                run_check(
                    env,
                    duration_s=duration_s,
                    fault_rate=0.0,
                    progress=lambda _: None,
                    report=report,
                    exec_jobs=False,
                    fail_fast=True,  # a corrupted run ends at its first violation; a clean one runs out
                )
            )
        )
        thread.start()

        def wait_for_barriers(n: int) -> None:
            deadline = time.monotonic() + 120
            while report.barriers < n and thread.is_alive():
                assert time.monotonic() < deadline, "the checker run issued no barriers"
                time.sleep(0.1)

        def finish() -> CheckReport:
            thread.join(300)
            assert done, "the checker run did not finish"
            return done[0]

        yield env, wait_for_barriers, finish, thread.is_alive
        thread.join(300)


def _cp(env):
    return psycopg.connect(env.dsn, autocommit=True, options=f"-c search_path={env.schema}")


def _problems(report: CheckReport) -> list[str]:
    """What fails a run: violations, and anomalies at the levels that promise consistency."""
    return report.violations + [
        report.examples[lvl] for lvl in ("read-committed", "repeatable-read") if report.anomalies[lvl]
    ]


def test_a_clean_run_passes(live_run):
    """Without corruption the same run passes, with the coverage floor met."""
    _, wait_for_barriers, finish, _ = live_run
    report = finish()
    assert report.ok, json.dumps(report.to_json())
    assert report.coverage >= report.coverage_floor and report.reads["read-committed"] > 0


def test_a_deleted_barrier_record_is_reported(live_run):
    """Deleting the newest barrier->snapshot record of a root table is caught."""
    env, wait_for_barriers, finish, _ = live_run
    wait_for_barriers(4)
    with _cp(env) as c:
        deleted = c.execute(
            "DELETE FROM table_commit WHERE commit_id = (SELECT max(commit_id) FROM table_commit "
            "JOIN managed_table USING (table_id) WHERE name = %s) RETURNING barrier, snapshot_id",
            (str(env.t("orders")),),
        ).fetchone()
    assert deleted is not None
    report = finish()
    assert not report.ok, report.to_json()
    assert any("orders" in p or "payment" in p for p in _problems(report)), report.to_json()


@pytest.mark.parametrize("live_run", [120], indirect=True)
def test_a_pinned_snapshot_expired_behind_the_control_planes_back_is_reported(live_run):
    """Expiring a lease-pinned snapshot with plain PyIceberg (no lease check) is caught. A
    repeatable-read session must pin a snapshot its table then moves past while the run still
    reads: the test looks for one as long as the run goes (up to 120 s; in 10 s on a loaded 2-core
    machine none had, and in 60 s of a full suite's load none had once). The corruption ends the
    run at once (fail-fast): alone it takes about 20 s."""
    env, wait_for_barriers, finish, running = live_run
    wait_for_barriers(3)
    catalog = load_catalog(env.settings)
    victim = None
    while victim is None and running():
        with _cp(env) as c:
            pinned = c.execute(
                "SELECT table_name, snapshot_id FROM active_leases WHERE holder = 'check-session' "
                "AND snapshot_id IS NOT NULL"
            ).fetchall()
        for table_name, snapshot_id in pinned:
            tbl = load_table(catalog, env.t(table_name.rsplit(".", 1)[1]))
            if tbl.current_snapshot().snapshot_id != snapshot_id:
                try:
                    retry_commit(
                        lambda: (
                            load_table(catalog, env.t(table_name.rsplit(".", 1)[1]))
                            .maintenance.expire_snapshots()
                            .by_ids([snapshot_id])
                            .commit()
                        )
                    )
                except ValueError as gone:  # its session ended meanwhile and the run's expiry took it
                    assert "does not exist" in str(gone), gone
                    with _cp(env) as c:  # gone while still pinned would be the product's fault, not a race
                        pinned_still = c.execute(
                            "SELECT 1 FROM active_leases WHERE snapshot_id = %s", (snapshot_id,)
                        ).fetchone()
                    assert pinned_still is None, f"snapshot {snapshot_id} expired while a lease pins it"
                    continue
                with _cp(env) as c:  # still pinned after the expiry: a real corruption, not a late one
                    still = c.execute(
                        "SELECT 1 FROM active_leases WHERE holder = 'check-session' AND snapshot_id = %s",
                        (snapshot_id,),
                    ).fetchone()
                if still:
                    victim = (table_name, snapshot_id)
                    break
        time.sleep(0.1)
    assert victim is not None, f"no repeatable-read lease pinned a non-current snapshot: {finish().to_json()}"
    report = finish()
    assert not report.ok, report.to_json()
    assert any(str(victim[1]) in p or "read failed" in p for p in _problems(report)), report.to_json()


def test_a_second_commit_for_a_table_and_barrier_is_reported(live_run):
    """Appending a second snapshot tagged with an already committed barrier is caught."""
    env, wait_for_barriers, finish, _ = live_run
    wait_for_barriers(4)
    with _cp(env) as c:
        barrier = c.execute(
            "SELECT max(c.barrier) FROM table_commit c JOIN managed_table m USING (table_id) WHERE m.name = %s",
            (str(env.t("orders")),),
        ).fetchone()[0]
    catalog = load_catalog(env.settings)
    extra = events(SEED, "orders", 0, 4)
    props = {SUMMARY_BARRIER: str(barrier), SUMMARY_JOB: "orders_in", SUMMARY_RUN: "mutant"}
    retry_commit(
        lambda: load_table(catalog, env.t("orders")).append(
            pa.Table.from_batches(extra.to_batches(), extra.schema), snapshot_properties=props
        )
    )
    report = finish()
    assert not report.ok, report.to_json()
    assert any("orders" in p for p in _problems(report)), report.to_json()


def test_a_coalesced_completion_recorded_as_exact_is_reported(live_run):
    """A control plane that records the jobs' coalesced ranges as exact completions (the ranges
    dropped by a trigger) accepts cuts at barriers no table computed: caught."""
    env, wait_for_barriers, finish, _ = live_run
    wait_for_barriers(1)
    with _cp(env) as c:
        c.execute("""
            CREATE FUNCTION mutant_forget() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;
            CREATE TRIGGER mutant_forget BEFORE INSERT ON coalesced_range
                FOR EACH ROW EXECUTE FUNCTION mutant_forget();
            CREATE FUNCTION mutant_exact() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN NEW.coalesced_after := OLD.coalesced_after; NEW.coalesced_into := OLD.coalesced_into; RETURN NEW; END $$;
            CREATE TRIGGER mutant_exact BEFORE UPDATE ON managed_table FOR EACH ROW EXECUTE FUNCTION mutant_exact();
        """)
    report = finish()
    assert report.completions["coalesce"] > 0, report.to_json()  # the jobs did coalesce
    assert not report.ok, report.to_json()
    assert any("coalesced it" in p or "barrier #" in p for p in _problems(report)), report.to_json()


def test_a_skip_past_a_change_is_reported(live_run):
    """The control plane skipping jobs whose sources changed (``unchanged_until``, which both the
    set-wise skips and a job's plan ask, broken on purpose to see no change) is caught: the
    skipped tables at those barriers are not what their sources say."""
    env, wait_for_barriers, finish, _ = live_run
    wait_for_barriers(3)
    with _cp(env) as c:
        c.execute(
            "CREATE OR REPLACE FUNCTION unchanged_until(p_sources bigint[], p_after bigint, p_limit bigint) "
            "RETURNS bigint LANGUAGE sql STABLE RETURN p_limit"
        )
    report = finish()
    assert not report.ok, report.to_json()
    assert _problems(report), report.to_json()
