"""`icebarrier audit`: every administrative action leaves a row (who, what, when, the result),
appended in the action's transaction; filters by time, job and table."""

from __future__ import annotations

import getpass
import json

from icebarrier.control_plane import audit, jobs
from icebarrier.control_plane.errors import IcebarrierError
from tests.helpers import job


def _events(cli, *args: str) -> list[dict]:
    done = cli("audit", *args, output="json")
    assert done.exit_code == 0, done.output
    return json.loads(done.stdout)


def test_admin_actions_are_in_the_trail_with_who_did_them(cli, conn):
    earlier = len(_events(cli))  # the fixture's own settings
    assert cli("job", "register", "ingest", "--external", "kafka:orders", "--sink", "lake.db.orders").exit_code == 0
    assert cli("job", "register", "agg", "--source", "lake.db.orders", "--sink", "lake.db.daily").exit_code == 0
    made = json.loads(cli("token", "create", "--job", "ingest", output="json").stdout)
    assert cli("token", "revoke", made["client_id"]).exit_code == 0
    assert cli("barrier", "interval", "30s").exit_code == 0
    b = json.loads(cli("job", "next-barrier", "ingest", output="json").stdout)["barrier"]
    cli("job", "complete", "ingest", "--barrier", str(b), "--commit", "lake.db.orders=42")
    cli("job", "complete", "agg", "--barrier", str(b), "--commit", "lake.db.daily=7")
    lease = json.loads(cli("lease", "acquire", "lake.db.orders", output="json").stdout)["lease_id"]
    assert cli("lease", "release", lease).exit_code == 0
    assert cli("job", "unregister", "agg").exit_code == 0

    events = _events(cli)[earlier:]
    actions = [(e["action"], e["job"], e["object"]) for e in events]
    assert actions == [
        ("job register", "ingest", None),
        ("job register", "agg", None),
        ("token create", "ingest", made["client_id"]),
        ("token revoke", "ingest", made["client_id"]),
        ("setting", None, "barrier_interval_ms"),
        ("lease acquire", None, f"lease {lease}"),
        ("lease release", None, f"lease {lease}"),
        ("job unregister", "agg", None),
    ], actions
    assert {e["actor"] for e in events} == {f"cli:{getpass.getuser()}"}
    assert all(e["result"] == "done" and e["role"] for e in events)

    assert [e["action"] for e in _events(cli, "--job", "agg")] == ["job register", "job unregister"]
    assert _events(cli, "--since", "2999-01-01T00:00:00Z") == []
    assert len(_events(cli, "--since", "1h")) == earlier + len(events)
    assert [e["action"] for e in _events(cli, "--limit", "1")] == ["job unregister"]
    text = cli("audit")
    assert "token revoke" in text.stdout and f"cli:{getpass.getuser()}" in text.stdout


def test_an_action_that_fails_leaves_no_row_and_a_bad_filter_is_one_line(cli, conn):
    before = audit.events(conn)
    try:
        with conn.transaction():
            jobs.register(conn, job("ghost", sinks=["ghost_out"]))
            raise IcebarrierError("rolled back")
    except IcebarrierError:
        pass
    assert audit.events(conn) == before  # no action, no row
    done = cli("audit", "--since", "yesterday")
    assert done.exit_code == 1 and done.stderr.strip().splitlines() == [
        "error: --since 'yesterday' is neither a duration (e.g. 1h, 2d) nor an ISO 8601 time "
        "(e.g. 2026-11-25T08:00:00Z)"
    ]
    assert cli("audit", "--table", "not a table").exit_code == 1
