"""The icebarrier command: help, text and JSON output, one-line errors and exit codes."""

import json

import click
import pytest
from click.testing import CliRunner

from icebarrier.cli.main import cli as command
from icebarrier.control_plane import jobs
from icebarrier.control_plane.model import barrier_label
from tests.helpers import job as define


def _all_commands(group: click.Group, prefix=()):
    for name, cmd in group.commands.items():
        yield (*prefix, name)
        if isinstance(cmd, click.Group):
            yield from _all_commands(cmd, (*prefix, name))


@pytest.mark.parametrize("path", list(_all_commands(command)))
def test_every_command_has_help(path):
    """Every command and group answers --help with a description."""
    result = CliRunner().invoke(command, [*path, "--help"])
    assert result.exit_code == 0
    assert "Usage:" in result.output
    cmd = command
    for part in path:
        cmd = cmd.commands[part]
    assert (cmd.help or "").strip(), f"{' '.join(path)} has no help text"


def _json(result):
    assert result.exit_code == 0, result.output + result.stderr
    return json.loads(result.stdout)


def _error(result):
    """A refused operation: exit 1, one line on stderr starting with 'error:', no traceback."""
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_pipeline_end_to_end(cli):
    """Register a chain, drive a barrier through it, then read it back every way."""
    assert cli("job", "register", "ingest", "--external", "kafka:orders", "--sink", "lake.db.orders").exit_code == 0
    cli("job", "register", "agg", "--source", "lake.db.orders", "--sink", "lake.db.daily")
    assert (
        _json(cli("job", "register", "agg", "--source", "lake.db.orders", "--sink", "lake.db.daily", output="json"))[
            "status"
        ]
        == "unchanged"
    )

    nb = _json(cli("job", "next-barrier", "ingest", output="json"))
    assert nb["ready"] and nb["issued"]
    b = nb["barrier"]
    done = _json(cli("job", "complete", "ingest", "--barrier", str(b), "--commit", "lake.db.orders=42", output="json"))
    assert done == {
        "job": "ingest",
        "barrier": b,
        "commits": {"lake.db.orders": 42},
        "sinks": ["lake.db.orders"],
        "noop": False,
        "coalesced": False,
    }
    cli("job", "complete", "agg", "--barrier", str(b), "--commit", "lake.db.daily=7")

    cut = _json(cli("cut", "lake.db.orders", "lake.db.daily", output="json"))
    assert cut["barrier"] == b and cut["snapshots"] == {"lake.db.daily": 7, "lake.db.orders": 42}
    lease = _json(cli("lease", "acquire", "lake.db.orders", "--ttl", "5m", "--holder", "bi", output="json"))
    assert lease["lease_id"] and lease["level"] == "repeatable-read"
    assert _json(cli("lease", "list", output="json"))[0]["holder"] == "bi"
    prot = _json(cli("protected", "lake.db.orders", output="json"))
    assert f"lease:{lease['lease_id']}" in prot["protected"]["42"]
    assert _json(cli("lease", "release", lease["lease_id"], output="json"))["state"] == "released"

    tables = _json(cli("table", "list", output="json"))
    assert [(t["table"], t["kind"], t["watermark"]) for t in tables] == [
        ("lake.db.daily", "intermediate", b),
        ("lake.db.orders", "root", b),
    ]
    jobs = _json(cli("job", "list", output="json"))
    assert {j["job"]: j["progress"] for j in jobs} == {"agg": b, "ingest": b}
    lineage = _json(cli("lineage", "lake.db.orders", output="json"))
    assert lineage["steps"] == [{"table": "lake.db.daily", "job": "agg", "depth": 1}]
    delay = _json(cli("delay", output="json"))
    assert {d["name"] for d in delay["jobs"]} == {"agg", "ingest"}

    text = cli("table", "list").stdout
    assert "lake.db.orders" in text and "root" in text and "TABLE" in text
    assert "flowchart LR" in cli("topology", "--format", "mermaid").stdout
    assert "digraph" in cli("topology", "--format", "dot").stdout
    assert "--[agg (intermediate)]-->" in cli("topology").stdout
    assert "bottleneck" in cli("delay").stdout
    assert str(b) in cli("barrier", "list").stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["job", "register", "x", "--external", "e", "--sink", "orders"], "table name 'orders' is invalid"),
        (["job", "register", "x;y", "--external", "e", "--sink", "lake.db.t"], "job name 'x;y' is invalid"),
        (["job", "register", "x", "--sink", "lake.db.t"], "reads nothing"),
        (["job", "complete", "ghost", "--barrier", "1"], "job ghost is not registered"),
        (["job", "complete", "ghost", "--barrier", "1", "--commit", "lake.db.t"], "use TABLE=SNAPSHOT_ID"),
        (["cut", "lake.db.nope"], "table lake.db.nope is not managed"),
        (["lease", "renew", "00000000-0000-0000-0000-000000000000"], "does not exist"),
        (["lease", "acquire", "lake.db.nope", "--ttl", "0s"], "duration '0s' is invalid"),
        (["barrier", "interval", "soon"], "duration 'soon' is invalid"),
        (["lineage", "lake.db.nope"], "not managed"),
        (["db", "grant-reader", "no_such_role_x"], "CREATE ROLE no_such_role_x"),
    ],
)
def test_refusals_are_one_line_with_exit_1(cli, args, fragment):
    """Bad input gets one line naming the object and the fix, exit 1, no traceback."""
    assert fragment in _error(cli(*args))


def test_refusal_writes_nothing(cli, conn):
    """A refused registration leaves the control plane unchanged."""
    cli("job", "register", "a", "--external", "e", "--sink", "lake.db.t")
    before = conn.execute("SELECT count(*) AS n FROM managed_table").fetchone()["n"]
    line = _error(cli("job", "register", "b", "--external", "e", "--sink", "lake.db.t", "--sink", "lake.db.u"))
    assert "written by job a" in line
    assert conn.execute("SELECT count(*) AS n FROM managed_table").fetchone()["n"] == before


def test_bad_usage_exits_2(cli):
    """Malformed usage (unknown option, missing argument) is exit 2."""
    assert cli("job", "complete", "x").exit_code == 2
    assert cli("cut", "--level", "serializable", "lake.db.t").exit_code == 2
    assert cli("no-such-command").exit_code == 2


def test_out_of_date_schema_is_refused(make_db, monkeypatch):
    """Every command refuses an unmigrated database and says to run db upgrade."""
    monkeypatch.setenv("ICEBARRIER_DSN", make_db())
    runner = CliRunner()
    result = runner.invoke(command, ["job", "list"])
    assert result.exit_code == 1 and "run `icebarrier db upgrade`" in result.stderr
    status = runner.invoke(command, ["--output", "json", "db", "status"])
    assert json.loads(status.stdout)["up_to_date"] is False
    assert runner.invoke(command, ["db", "upgrade"]).exit_code == 0
    assert runner.invoke(command, ["job", "list"]).exit_code == 0


def test_missing_dsn_is_a_clear_error(monkeypatch):
    """Without --dsn or ICEBARRIER_DSN the error says how to give one."""
    monkeypatch.delenv("ICEBARRIER_DSN", raising=False)
    result = CliRunner().invoke(command, ["job", "list"])
    assert result.exit_code == 1 and "pass --dsn or set ICEBARRIER_DSN" in result.stderr


def test_debug_shows_the_traceback(cli, dsn):
    """--debug lets the exception through for a traceback."""
    from icebarrier.control_plane.errors import JobNotFoundError

    with pytest.raises(JobNotFoundError):
        CliRunner().invoke(command, ["--debug", "job", "show", "ghost"], catch_exceptions=False)


def test_console_script_runs_as_a_process(dsn):
    """The installed `icebarrier` entry point works as a real process with exit codes."""
    import subprocess
    import sys

    ok = subprocess.run(
        [sys.executable, "-m", "icebarrier.cli.main", "--dsn", dsn, "barrier", "issue"], capture_output=True, text=True
    )
    assert ok.returncode == 0 and "issued barrier" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "icebarrier.cli.main", "--dsn", dsn, "job", "show", "ghost"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_a_read_waits_for_the_first_cut_and_names_the_job(cli, dsn):
    """`cut` with no valid cut yet waits (bounded), says which job it waits for, then reads the
    cut once the job completes its first barrier; with --wait 0s it fails at once."""
    import subprocess
    import sys

    from icebarrier.control_plane import barriers, db, jobs
    from tests.helpers import T, job

    with db.connect(dsn) as c:
        jobs.register(c, job("ingest", sinks=["orders"]))
        b = barriers.issue(c).barrier
    assert cli("cut", str(T("orders")), "--wait", "0s").exit_code == 1
    proc = subprocess.Popen(
        [sys.executable, "-m", "icebarrier.cli.main", "--output", "json", "cut", str(T("orders")), "--wait", "60s"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    said = proc.stderr.readline()  # once it waits (however long the machine takes to start it)
    assert "waiting for a first consistent cut: job ingest (lake.db.orders has completed no barrier yet)" in said
    assert proc.poll() is None, proc.communicate()  # still waiting
    with db.connect(dsn) as c:
        jobs.complete(c, "ingest", b, {T("orders"): 101})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, said + err
    assert json.loads(out)["barrier"] == b


def test_plans_coalescing_and_anchors_from_the_cli(cli):
    """`job next-barrier` prints the plan; `job complete --coalesce` records a coalesced range; a
    cut inside it is refused in one line naming the table; `barrier anchor-interval` sets anchors."""
    assert _json(cli("barrier", "anchor-interval", "1d", output="json")) == {"anchor_interval_s": 86400.0}
    cli("job", "register", "ingest", "--external", "kafka:orders", "--sink", "lake.db.orders")
    cli("job", "register", "agg", "--source", "lake.db.orders", "--sink", "lake.db.daily")
    first = _json(cli("barrier", "issue", output="json"))["barrier"]
    for job, table in (("ingest", "orders"), ("agg", "daily")):
        cli("job", "complete", job, "--barrier", str(first), "--commit", f"lake.db.{table}=1")
    b1, b2 = (_json(cli("barrier", "issue", output="json"))["barrier"] for _ in range(2))
    cli("job", "complete", "ingest", "--barrier", str(b1), "--commit", "lake.db.orders=2")
    cli("job", "complete", "ingest", "--barrier", str(b2), "--commit", "lake.db.orders=3")
    nb = _json(cli("job", "next-barrier", "agg", output="json"))
    assert {k: nb[k] for k in ("barrier", "plan", "from_barrier", "anchors_in_range", "ready")} == {
        "barrier": b2,
        "plan": "coalesce",
        "from_barrier": first,
        "anchors_in_range": 0,
        "ready": True,
    }
    assert (
        f"next barrier {barrier_label(b2)}, coalesce from {barrier_label(first)}"
        in cli("job", "next-barrier", "agg").stdout
    )
    assert "must complete barrier" in _error(cli("job", "complete", "agg", "--barrier", str(b2)))
    done = _json(
        cli("job", "complete", "agg", "--barrier", str(b2), "--commit", "lake.db.daily=9", "--coalesce", output="json")
    )
    assert done["coalesced"] is True
    line = _error(cli("cut", "lake.db.orders", "lake.db.daily", "--barrier", str(b1)))
    assert f"lake.db.daily coalesced it into barrier {b2}" in line and f"{first} (before)" in line
    daily = next(t for t in _json(cli("table", "list", output="json")) if t["table"] == "lake.db.daily")
    assert (daily["coalesced_after"], daily["coalesced_into"]) == (first, b2)


def test_declared_freshness_from_the_cli(cli, conn):
    """Targets set on a table or on `job register`, inherited upstream, shown by `table list`;
    runners registered with the job; `schedule --dry-run` prints the plan; `delay` the misses;
    bad inputs refused in one line, writing nothing."""
    from icebarrier.control_plane import targets

    assert (
        cli(
            "job",
            "register",
            "ingest",
            "--external",
            "kafka:orders",
            "--sink",
            "lake.db.orders",
            "--command",
            "python ingest.py",
            "--env",
            "TOKEN=s3cr3t",
        ).exit_code
        == 0
    )
    registered = _json(
        cli(
            "job",
            "register",
            "agg",
            "--source",
            "lake.db.orders",
            "--sink",
            "lake.db.daily",
            "--command",
            "python agg.py",
            "--target-lag",
            "90s",
            output="json",
        )
    )
    assert registered["target_lag_s"] == 90 and registered["runner"] == {
        "kind": "command",
        "spec": "python agg.py",
        "env": [],
    }
    listed = {t["table"]: t for t in _json(cli("table", "list", output="json"))}
    assert listed["lake.db.daily"]["effective_target_lag_s"] == 90
    assert listed["lake.db.orders"]["target_from"] == "lake.db.daily"  # inherited
    text = cli("table", "list").output
    assert "90s MISSED" in text and "<- lake.db.daily" in text  # never completed: not fresh
    assert cli("table", "target-lag", "lake.db.orders", "30s").output == "table lake.db.orders: target lag 30s\n"
    assert targets.runners(conn)["ingest"].env == {"TOKEN": "s3cr3t"}

    plan = {d["table"]: d for d in _json(cli("schedule", "--dry-run", output="json"))}
    assert set(plan) == {"lake.db.daily", "lake.db.orders"}  # each has a target of its own now
    assert plan["lake.db.daily"]["jobs"] == ["ingest", "agg"] and plan["lake.db.daily"]["due_in_s"] is None
    assert "ingest -> agg" in cli("schedule", "--dry-run").output

    b = _json(cli("job", "next-barrier", "ingest", output="json"))["barrier"]
    cli("job", "complete", "ingest", "--barrier", str(b), "--commit", "lake.db.orders=1")
    cli("table", "target-lag", "lake.db.orders", "1ms")
    misses = _json(cli("delay", output="json"))["target_misses"]
    assert [m["table"] for m in misses if m["missed_until"] is None] == ["lake.db.orders"]
    assert "target misses" in cli("delay").output
    assert _json(cli("table", "target-lag", "lake.db.orders", "--clear", output="json"))["target_lag_s"] is None

    for args, fragment in (
        (["table", "target-lag", "lake.db.nope", "5m"], "lake.db.nope"),
        (["table", "target-lag", "lake.db.daily", "soon"], "soon"),
    ):
        assert fragment in _error(cli(*args))
    for args in (
        ["table", "target-lag", "lake.db.daily"],
        ["job", "register", "x", "--sink", "lake.db.x", "--command", "a", "--file", __file__],
        ["job", "register", "x", "--sink", "lake.db.x", "--env", "A=1"],
        ["job", "register", "x", "--sink", "lake.db.x", "--command", "a", "--env", "novalue"],
    ):
        assert cli(*args).exit_code == 2, args
    assert "x" not in {j["job"] for j in _json(cli("job", "list", output="json"))}


def test_long_listings_page_and_say_how_to_get_the_next(cli, conn):
    """`table list` and `job list` print a page (--limit, 1,000 by default) by name, and say on
    standard error how to get the next page (--after the last name); following the hints walks
    every row once; --all prints them all."""
    for i in range(7):
        jobs.register(conn, define(f"j{i}", sinks=[f"t{i}"]))
    for listing, key in ((("table", "list"), "table"), (("job", "list"), "job")):
        seen, after = [], []
        while True:
            result = cli(*listing, "--limit", "3", *after, output="json")
            assert result.exit_code == 0
            seen += [r[key] for r in json.loads(result.stdout)]
            if not result.stderr:
                break
            assert result.stderr.startswith("3 ") and "more follow; the next page: icebarrier" in result.stderr
            after = ["--after", result.stderr.split("--after ")[1].split(" ")[0]]
        assert seen == sorted(seen) and len(seen) == len(set(seen)) == 7, seen
        assert len(json.loads(cli(*listing, "--all", output="json").stdout)) == 7
        assert "more follow" not in cli(*listing).stderr  # 7 < 1,000
