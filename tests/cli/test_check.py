"""The consistency checker: its model and invariants, and a short seeded run with real faults."""

import json
import os
import pty
import re
import shutil
import subprocess
import sys
import threading

import pyarrow as pa
import pytest

from icebarrier.apps.check import ACCOUNTS, OPENING, SCHEMAS, check_cut, events

# embedded servers one at a time (tests/conftest.py, pytest_collection_modifyitems)
pytestmark = pytest.mark.xdist_group("embedded-postgres")


def _cut(orders, payments, ledger_rows, balances, paid):
    return {
        "orders": pa.table({"order_id": pa.array(orders, pa.int64())}, schema=SCHEMAS["orders"]),
        "payments": pa.table(
            {"order_id": pa.array(payments, pa.int64()), "t": pa.array(payments, pa.int64())},
            schema=SCHEMAS["payments"],
        ),
        "ledger": pa.table(
            {
                "transfer_id": pa.array([r[0] for r in ledger_rows], pa.int64()),
                "account": pa.array([r[1] for r in ledger_rows], pa.int64()),
                "delta": pa.array([r[2] for r in ledger_rows], pa.int64()),
            },
            schema=SCHEMAS["ledger"],
        ),
        "balances": pa.table(
            {"account": pa.array(list(balances), pa.int64()), "balance": pa.array(list(balances.values()), pa.int64())},
            schema=SCHEMAS["balances"],
        ),
        "paid": pa.table(
            {"payments": pa.array([paid[0]], pa.int64()), "with_order": pa.array([paid[1]], pa.int64())},
            schema=SCHEMAS["paid"],
        ),
    }


def test_invariants_catch_each_anomaly():
    """A consistent cut passes; an orphan payment, a stale balance or a stale count is caught."""
    ok_balances = {a: OPENING for a in range(ACCOUNTS)}
    ok_balances[0], ok_balances[1] = OPENING - 5, OPENING + 5
    ledger = [(1, 0, -5), (1, 1, 5)]
    assert check_cut(_cut([1, 2], [1], ledger, ok_balances, (1, 1))) is None
    assert "without its order" in check_cut(_cut([1], [1, 2], ledger, ok_balances, (2, 2)))
    stale = {a: OPENING for a in range(ACCOUNTS)}
    assert "ledger gives" in check_cut(_cut([1], [1], ledger, stale, (1, 1)))
    assert "paid says" in check_cut(_cut([1, 2], [1, 2], ledger, ok_balances, (1, 1)))


def test_model_inputs_are_deterministic_and_keep_transfers_whole():
    """The model's rows are a pure function of the seed; every transfer's legs sum to zero."""
    assert events(5, "payments", 0, 40).equals(events(5, "payments", 0, 40))
    ledger = events(5, "ledger", 0, 20)
    assert sum(ledger["delta"].to_pylist()) == 0 and ledger.num_rows == 40
    split = [events(5, "payments", a, a + 4) for a in range(0, 40, 4)]
    assert sum(t.num_rows for t in split) == events(5, "payments", 0, 40).num_rows


@pytest.mark.slow
def test_short_seeded_check_run_on_s3_passes(s3, tmp_path):
    """A seeded run on its private embedded Postgres, its warehouse on S3 (`--warehouse s3://…`,
    the storage settings in icebarrier.toml), restarted mid-run, with jobs killed at random fault
    points: no anomaly at read-committed or repeatable-read, nothing lost or duplicated, no
    pinned snapshot expired, coverage above the floor, renewals exercised; its tables' files are
    in the bucket. (The other passing runs below keep their warehouse in a local folder.)"""
    config = tmp_path / "icebarrier.toml"
    config.write_text(s3.storage_toml())
    code, stdout, terminal = _with_terminal_stderr(
        [
            sys.executable,
            "-m",
            "icebarrier.cli.main",
            "--config",
            str(config),
            "--output",
            "json",
            "check",
            "--seed",
            "12",
            "--duration",
            "15",
            "--fault-rate",
            "0.6",
            "--warehouse",
            f"s3://{s3.bucket}/checks",
            "--keep",  # its tables' files stay in the bucket to be looked at (its local state removed below)
        ]
    )
    if kept := re.search(r"check: kept (\S+)", terminal):
        shutil.rmtree(kept.group(1), ignore_errors=True)
    assert code == 0, terminal[-3000:] + stdout[-3000:]
    # on a terminal, a live line shows the run as it goes; the messages stay above it
    live = r"\d+ barriers issued, \d+ validated, \d+ reads \(0 anomalies at consistent levels"
    assert re.search(live, terminal), terminal[-3000:]
    assert "check: seed 12" in terminal and "waiting for every job to complete the last" in terminal
    report = json.loads(stdout)
    assert report["ok"] and report["reads"]["read-committed"] > 0 and report["reads"]["read-uncommitted"] > 0
    assert report["coverage"] >= report["coverage_floor"] and report["validated"] > 0
    assert report["restarts"] >= 1 and report["reconnects"] > 0 and sum(report["faults"].values()) > 0
    assert report["expiry_runs"] > 0 and report["rr_sessions"] > 0
    # two jobs ran under `icebarrier job exec`, through a catalog server the run killed; cuts
    # were validated through the catalog's barrier-<B> warehouse and read through read-committed
    assert report["exec_jobs"] == ["balances_job", "orders_in"] and report["mutation"] is None
    assert report["faults"].get("catalog server@killed", 0) >= 1
    # and stopped with SIGTERM: it drained (long polls answered at once) and exited
    assert report["faults"].get("catalog server@SIGTERM", 0) >= 1 and report["catalog"]["stop_s"]
    assert report["catalog"]["validated"] > 0 and report["catalog"]["reads"] > 0
    assert report["catalog"]["planned"] > 0  # reads planned on the server, checked against the model too
    assert report["catalog"]["anomalies"] == 0
    tables = {k.split("/")[3] for k in s3.keys("checks/check-12-") if k.count("/") > 3}
    assert {"orders", "payments", "ledger", "balances", "paid"} <= tables, tables


def _check(*options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "icebarrier.cli.main", "--output", "json", "check", *options],
        capture_output=True,
        text=True,
        timeout=900,
    )


def _maintained_mutation(mutation: str) -> subprocess.CompletedProcess:
    """A run with the maintenance service beside `job exec` jobs and ``mutation``, ended at its
    first violation."""
    return _check(
        "--seed", "12", "--duration", "18", "--fault-rate", "0.4", "--maintain", "--mutation", mutation, "--fail-fast"
    )


@pytest.mark.slow
def test_a_check_run_with_a_kafka_root_job_passes_and_a_read_uncommitted_source_fails_it():
    """`check --kafka`: orders_in reads its orders from a real broker (each barrier's produced just
    before it, an aborted transaction of orders beside them), killed at fault points, validated
    against the model; a source reading read_uncommitted (ICEBARRIER_MUTATION=kafka-uncommitted)
    lets the aborted orders in and must fail the run, for that reason."""
    done = _check("--seed", "5", "--duration", "14", "--kafka")
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    report = json.loads(done.stdout)
    assert report["ok"] and report["kafka"] and report["exec_jobs"] == ["balances_job"]
    assert report["validated"] > 0 and report["anchors_validated"] > 0
    bad = _check("--seed", "5", "--duration", "10", "--kafka", "--mutation", "kafka-uncommitted", "--fail-fast")
    assert bad.returncode == 1, bad.stderr[-3000:]
    violations = json.loads(bad.stdout)["violations"]
    assert any(re.search(r"orders at barrier #\d+: \d+ rows \(0 duplicated\), model has", v) for v in violations), (
        violations
    )


@pytest.mark.slow
def test_a_check_run_with_the_maintenance_service_across_failovers_passes():
    """`check --maintain --failover`: the maintenance service in place of the expiry process,
    with aggressive policies, killed and restarted by the fault schedule while jobs die; the
    control plane on a primary and a synchronous standby, and where the run would restart
    Postgres the primary is killed (-9) and the standby promoted. Every job, the catalog server,
    the readers and the service follow the multi-host DSN (the service's lease holds its fence
    across the switch); it expires and compacts, and the run has no anomaly, nothing acknowledged
    lost or duplicated, no pinned snapshot expired. (Plain restarts: the other runs here.)"""
    done = _check("--seed", "12", "--duration", "24", "--fault-rate", "0.4", "--maintain", "--failover")
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    report = json.loads(done.stdout)
    assert report["ok"] and report["faults"].get("maintain@killed", 0) >= 1, report["faults"]
    assert report["maintenance"].get("compact done", 0) >= 1, report["maintenance"]
    assert report["maintenance"].get("expire done", 0) >= 1, report["maintenance"]
    assert report["failovers"] >= 1 and report["failovers"] == report["restarts"] and report["validated"] > 0
    assert "failing over: the primary killed" in done.stderr


@pytest.mark.slow
def test_a_maintenance_service_that_expires_protected_snapshots_fails_the_check():
    """The checker's test of itself with maintenance: expiry ignoring the protected set
    (ICEBARRIER_MUTATION=expire-protected) must fail the run, for that reason: a reader finds a
    protected snapshot expired (directly, or through the catalog: "already expired"), or a job dies
    reading the manifest list of a snapshot whose files expiry deleted (which comes first depends
    on timing; the run ends at the first, --fail-fast)."""
    done = _maintained_mutation("expire-protected")
    assert done.returncode == 1, done.stderr[-3000:]
    said = done.stdout + done.stderr
    expired = any(why in said for why in ("but was expired", "Snapshot not found", "was already expired"))
    files_gone = "check process" in said and re.search(r"Failed to open local file '[^']*/metadata/snap-", said)
    assert expired or files_gone, said[-3000:]


@pytest.mark.slow
def test_maintenance_that_wins_a_race_with_a_publish_fails_the_check():
    """The checker's test of itself with maintenance beside `job exec` jobs: a server that cannot
    replay a job's commit over a compaction, with a service that compacts under staged sessions
    (ICEBARRIER_MUTATION=no-rebase: the race issue 48 found), must fail the run for that reason,
    though `job exec --follow` survives the refusals by running the barrier again."""
    done = _maintained_mutation("no-rebase")
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert not report["ok"] and report["mutation"] == "no-rebase"
    # the audit of the jobs' logs says it, or (a refusal five times in a row) job exec's exit does
    assert any("was changed outside the barrier staged for it" in v for v in report["violations"]), report["violations"]


@pytest.mark.slow
def test_a_server_that_publishes_non_atomically_fails_the_check():
    """The checker's mutation test: a catalog server publishing a session's staged commits one
    transaction at a time (ICEBARRIER_MUTATION=nonatomic-publish) must fail the run."""
    done = _check("--seed", "11", "--duration", "12", "--mutation", "nonatomic-publish", "--fail-fast")
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert not report["ok"] and report["mutation"] == "nonatomic-publish"
    assert any("visible before its barrier completed" in v for v in report["violations"]), report["violations"]


@pytest.mark.slow
def test_a_server_that_plans_scans_at_the_newest_snapshot_fails_the_check():
    """The checker's mutation test for scan planning: a catalog server planning every scan at
    the table's newest snapshot (ICEBARRIER_MUTATION=plan-at-latest) instead of the warehouse's
    cut must fail the run: a barrier's cut read through the catalog, planned on the server, is
    not the model's."""
    done = _check("--seed", "11", "--duration", "12", "--mutation", "plan-at-latest", "--fail-fast")
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert not report["ok"] and report["mutation"] == "plan-at-latest"
    # a barrier's cut validated through the catalog, or a read-committed read through it (which a
    # loaded machine may reach first), planned at the newest snapshot: not the model's cut
    caught = [v for v in report["violations"] if "through the catalog" in v]
    assert caught or report["catalog"]["anomalies"] > 0, (report["violations"], report["catalog"])


def test_fault_schedule_is_a_function_of_the_seed():
    """The same seed gives the same kills, restarts and armed fault points; another seed differs."""
    from icebarrier.apps.check import fault_schedule
    from icebarrier.apps.check.fault_plan import launch_fault

    assert fault_schedule(7, 20, 0.3, restarts=True) == fault_schedule(7, 20, 0.3, restarts=True)
    assert fault_schedule(7, 20, 0.3, restarts=True) != fault_schedule(8, 20, 0.3, restarts=True)
    assert [launch_fault(7, "orders_in", n, 0.5) for n in range(10)] == [
        launch_fault(7, "orders_in", n, 0.5) for n in range(10)
    ]
    assert not [f for f in fault_schedule(7, 20, 0.3, restarts=False) if f.kind == "restart"]
    with_exec = fault_schedule(7, 60, 0.3, restarts=True, exec_jobs=True)
    assert {"kill", "script", "server", "server-term", "restart"} <= {f.kind for f in with_exec}
    assert not [f for f in fault_schedule(7, 60, 0.3, restarts=True) if f.kind in ("script", "server")]


def _with_terminal_stderr(args: list[str]) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal (what a person at a shell has) and stdout on a pipe:
    (exit code, stdout, everything the terminal showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "200"},
    )
    os.close(slave)
    shown: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: the process ended
                return
            if not chunk:
                return
            shown.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stdout, _ = proc.communicate(timeout=900)
    reader.join(timeout=10)
    os.close(master)
    return proc.returncode, stdout, b"".join(shown).decode(errors="replace")
