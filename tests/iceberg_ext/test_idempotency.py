"""Retries are safe: a request whose answer is lost on the way back (a proxy forwards it, the
server acts, the proxy closes the client's connection) and is sent again with its
``Idempotency-Key`` gets the first answer, and nothing is applied twice."""

from __future__ import annotations

import json
import uuid

import pyarrow as pa
import pytest
import requests
import uuid6

from icebarrier.control_plane import barriers, idempotency, jobs, tokens
from icebarrier.iceberg_ext.orphans import remove_orphans
from tests.dropping_proxy import DroppingProxy
from tests.iceberg_ext.catalog_server import Pipeline, access_token, rest, staged_change, start_server, stop_server
from tests.iceberg_ext.test_job_exec import command, job_exec, setup_pipeline

pytestmark = pytest.mark.slow

KEY = "Idempotency-Key"


@pytest.fixture
def proxy(server):
    p = DroppingProxy(server)
    yield p
    p.close()


def _lost_then_retried(proxy: DroppingProxy, server: str, method: str, path: str, body: str, headers: dict):
    """Send through the proxy, which drops the answer; then again, straight to the server, with
    the same key. The retry's response."""
    key = str(uuid6.uuid7())
    headers = {**headers, KEY: key, "Content-Type": "application/json"}
    proxy.drop = lambda m, p, h: h.get(KEY) == key
    with pytest.raises(requests.ConnectionError):
        requests.request(method, proxy.uri + path, data=body, headers=headers, timeout=60)
    [first] = [s for s in proxy.seen if s.headers.get(KEY) == key]
    assert first.dropped and first.status in (200, 204), first  # the server acted; the client never heard
    retry = requests.request(method, server + path, data=body, headers=headers, timeout=60)
    assert retry.headers.get("Idempotent-Replayed") == "true" and retry.status_code == first.status
    return retry


def test_a_lost_commit_answer_retried_with_its_key_is_answered_and_not_applied_again(lake, server, proxy):
    """One commit, its answer lost: the retry gets the same answer and the table has one new
    snapshot; the same request without the key is a conflict (what a client met before)."""
    p = Pipeline(lake, {"solo": ["facts"]})
    p.advance()
    job = f"{lake.namespace}_solo"
    jid, secret = tokens.create(lake.conn, job=job, whole_lake=True)
    writer = rest(server, "latest", f"{jid}:{secret}")
    auth = {"Authorization": f"Bearer {access_token(server, jid, secret)}"}
    b = barriers.issue(lake.conn).barrier
    change = staged_change(writer, f"{lake.namespace}.facts", b)
    path = f"/v1/latest/namespaces/{lake.namespace}/tables/facts"
    body = change.model_dump_json(exclude={"identifier"})
    retry = _lost_then_retried(proxy, server, "POST", path, body, auth)
    assert len(retry.json()["metadata"]["snapshots"]) == 2
    table = writer.load_table(f"{lake.namespace}.facts")
    assert len(table.metadata.snapshots) == 2 and retry.json()["metadata-location"] == table.metadata_location
    assert jobs.show(lake.conn, job).progress == b
    again = requests.post(server + path, data=body, headers={**auth, "Content-Type": "application/json"}, timeout=60)
    assert again.status_code == 409, again.text


def test_a_commit_answer_is_read_back_from_its_metadata_file_which_orphan_removal_keeps(lake, server):
    """A keyed commit keeps its answer by reference (the metadata file it wrote): a retry is
    answered byte for byte from the file, which orphan removal keeps while the key lives even
    once it has left the table's metadata log; with the file deleted (as a PyIceberg client
    deleting old metadata after commits does), the retry is answered with the table as it is."""
    Pipeline(lake, {"solo": ["facts"]})
    name = f"{lake.namespace}.facts"
    made = lake.catalog.load_table(name)
    with made.transaction() as tx:
        tx.set_properties({"write.metadata.previous-versions-max": "1"})
    jid, secret = tokens.create(lake.conn, job=f"{lake.namespace}_solo", whole_lake=True)
    auth = {"Authorization": f"Bearer {access_token(server, jid, secret)}"}
    url = f"{server}/v1/latest/namespaces/{lake.namespace}/tables/facts"

    def set_v(value: str, key: str | None = None, at: str = url) -> requests.Response:
        body = {"updates": [{"action": "set-properties", "updates": {"v": value}}], "requirements": []}
        answer = requests.post(at, json=body, headers={**auth, **({KEY: key} if key else {})}, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer

    key = str(uuid6.uuid7())
    first = set_v("1", key)
    kept = first.json()["metadata-location"]
    row = lake.conn.execute("SELECT body, metadata_location FROM idempotency_key WHERE key = %s", (key,)).fetchone()
    assert row["body"] is None and row["metadata_location"] == kept
    set_v("2")
    set_v("3")  # the first commit's file has left the metadata log (previous-versions-max 1)
    now = lake.catalog.load_table(name)
    assert kept not in {e.metadata_file for e in now.metadata.metadata_log} | {now.metadata_location}
    assert (
        kept
        not in remove_orphans(
            lake.conn,
            lake.catalog,
            lake.T("facts"),
            older_than_s=0,
            catalog_schema=lake.settings.catalog_schema,
        ).orphans
    )
    again = set_v("1", key)
    assert again.headers.get("Idempotent-Replayed") == "true" and again.content == first.content
    lake.conn.execute("UPDATE idempotency_key SET expires_at = now() - interval '1 second' WHERE key = %s", (key,))
    doomed = remove_orphans(
        lake.conn,
        lake.catalog,
        lake.T("facts"),
        older_than_s=0,
        dry_run=True,
        catalog_schema=lake.settings.catalog_schema,
    ).orphans
    assert kept in doomed  # the live key was what kept it
    lake.conn.execute("UPDATE idempotency_key SET expires_at = now() + interval '1 hour' WHERE key = %s", (key,))
    made.io.delete(kept)
    other, other_uri = start_server(lake)  # another server process: the file is in no cache of its own
    try:
        lost = set_v("1", key, at=url.replace(server, other_uri))
    finally:
        assert "Traceback" not in stop_server(other)
    assert lost.headers.get("Idempotent-Replayed") == "true"
    assert (
        lost.json()["metadata-location"] == now.metadata_location and lost.json()["metadata"]["properties"]["v"] == "3"
    )


def test_a_lost_transaction_answer_retried_with_its_key_commits_both_tables_once(lake, server, proxy):
    """A multi-table transaction, its answer lost: the retry is answered 204 and each table has
    exactly one new snapshot."""
    p = Pipeline(lake, {"pair": ["left", "right"]})
    p.advance()
    job = f"{lake.namespace}_pair"
    jid, secret = tokens.create(lake.conn, job=job, whole_lake=True)
    writer = rest(server, "latest", f"{jid}:{secret}")
    auth = {"Authorization": f"Bearer {access_token(server, jid, secret)}"}
    b = barriers.issue(lake.conn).barrier
    changes = [staged_change(writer, f"{lake.namespace}.{t}", b) for t in ("left", "right")]
    body = '{"table-changes": [' + ", ".join(c.model_dump_json() for c in changes) + "]}"
    _lost_then_retried(proxy, server, "POST", "/v1/latest/transactions/commit", body, auth)
    assert [len(writer.load_table(f"{lake.namespace}.{t}").metadata.snapshots) for t in ("left", "right")] == [2, 2]
    assert jobs.show(lake.conn, job).progress == b


def test_a_lost_publish_answer_is_retried_by_job_exec_and_published_once(lake, server, proxy):
    """`job exec` through the proxy, which drops the answer to its first publish: job exec sends
    the publish again with its key, is told the first outcome, and the barrier is published once
    (one publish in the audit trail, the rows written once)."""
    creds = setup_pipeline(lake)
    b = barriers.issue(lake.conn).barrier
    dropped = []

    def drop_first_publish(method, path, headers):
        if path.endswith("/session/publish") and not dropped:
            dropped.append(headers[KEY])
            return True
        return False

    proxy.drop = drop_first_publish
    out = job_exec(proxy.uri, creds["ingest"], "ingest", command(lake, "ingest", rows=3))
    assert [(s["barrier"], s["outcome"]) for s in out["steps"]] == [(b, "published")]
    publishes = [s for s in proxy.seen if s.path.endswith("/session/publish")]
    assert [s.headers[KEY] for s in publishes] == dropped * 2 and publishes[0].dropped
    assert jobs.show(lake.conn, "ingest").progress == b
    assert lake.catalog.load_table(f"{lake.namespace}.orders").scan().to_arrow().num_rows == 3
    audited = lake.conn.execute(
        "SELECT action FROM audit WHERE job_name = 'ingest' AND action LIKE 'session %%' ORDER BY event_id"
    ).fetchall()
    assert [r["action"] for r in audited] == ["session open", "session publish"]


def test_keys_are_checked_and_bound_to_one_request(lake, server):
    """A malformed key is a 400; the same key with another body is a 422; another token's key is
    refused without its answer; GET /v1/config advertises the keys' lifetime."""
    Pipeline(lake, {"solo": ["facts"]}).advance()
    jid, secret = tokens.create(lake.conn, job=f"{lake.namespace}_solo", whole_lake=True)
    other_id, other_secret = tokens.create(lake.conn, job=f"{lake.namespace}_solo", whole_lake=True)
    auth = {"Authorization": f"Bearer {access_token(server, jid, secret)}", "Content-Type": "application/json"}
    config = requests.get(f"{server}/v1/config", headers=auth, timeout=30).json()
    assert config["idempotency-key-lifetime"] == "PT30M"
    path = f"{server}/v1/latest/namespaces"
    for bad in ("nope", "0" * 36, str(uuid.uuid4()).replace("-", "")):
        r = requests.post(path, data=json.dumps({"namespace": ["n1"]}), headers={**auth, KEY: bad}, timeout=30)
        assert r.status_code == 400 and "Idempotency-Key" in r.json()["error"]["message"], r.text
    key = str(uuid6.uuid7())
    first = requests.post(
        path, data=json.dumps({"namespace": [f"{lake.namespace}_n"]}), headers={**auth, KEY: key}, timeout=30
    )
    assert first.status_code == 200, first.text
    assert (
        requests.post(
            path, data=json.dumps({"namespace": [f"{lake.namespace}_n"]}), headers={**auth, KEY: key}, timeout=30
        ).json()
        == first.json()
    )
    other = requests.post(
        path, data=json.dumps({"namespace": [f"{lake.namespace}_m"]}), headers={**auth, KEY: key}, timeout=30
    )
    assert other.status_code == 422 and "another request" in other.json()["error"]["message"]
    stolen = requests.post(
        path,
        data=json.dumps({"namespace": [f"{lake.namespace}_n"]}),
        timeout=30,
        headers={
            KEY: key,
            "Authorization": f"Bearer {access_token(server, other_id, other_secret)}",
            "Content-Type": "application/json",
        },
    )
    assert stolen.status_code == 422 and "namespace" not in stolen.text.replace("another request", "")
    # a refusal is final too: a retry of a 409 is the same 409, not a new attempt
    key2 = str(uuid6.uuid7())
    conflict = requests.post(
        path, data=json.dumps({"namespace": [f"{lake.namespace}_n"]}), headers={**auth, KEY: key2}, timeout=30
    )
    assert conflict.status_code == 409
    requests.delete(f"{path}/{lake.namespace}_n", headers=auth, timeout=30).raise_for_status()
    replayed = requests.post(
        path, data=json.dumps({"namespace": [f"{lake.namespace}_n"]}), headers={**auth, KEY: key2}, timeout=30
    )
    assert replayed.status_code == 409 and replayed.headers.get("Idempotent-Replayed") == "true"


def test_every_mutating_endpoint_sent_twice_with_one_key_acts_once(lake, server):
    """Each write route the server serves, sent again with the same key: the same answer
    (``Idempotent-Replayed``), and the action once (sent again without the key, each would be
    refused: the namespace or table exists, or is gone). The lost-answer tests above cover
    commit, transactions/commit and publish."""
    Pipeline(lake, {"solo": ["facts"]}).advance()
    jid, secret = tokens.create(lake.conn, job=f"{lake.namespace}_solo", whole_lake=True)
    auth = {"Authorization": f"Bearer {access_token(server, jid, secret)}"}
    ns = f"{lake.namespace}_twice"
    base = f"{server}/v1/latest"
    schema = {"type": "struct", "schema-id": 0, "fields": [{"id": 1, "name": "id", "type": "long", "required": False}]}
    made = lake.catalog.create_table(f"{lake.namespace}.to_register", schema=pa.schema([("id", pa.int64())]))
    lake.catalog.drop_table(f"{lake.namespace}.to_register")  # its files stay: registered below
    steps = [
        ("POST", f"{base}/namespaces", {"namespace": [ns]}, 409),
        ("POST", f"{base}/namespaces/{ns}/properties", {"updates": {"a": "1"}, "removals": []}, None),
        ("POST", f"{base}/namespaces/{ns}/tables", {"name": "t", "schema": schema}, 409),
        (
            "POST",
            f"{base}/namespaces/{lake.namespace}/register",
            {"name": "registered", "metadata-location": made.metadata_location},
            409,
        ),
        (
            "POST",
            f"{base}/tables/rename",
            {"source": {"namespace": [ns], "name": "t"}, "destination": {"namespace": [ns], "name": "u"}},
            404,
        ),
        ("DELETE", f"{base}/namespaces/{ns}/tables/u", None, 404),
        ("DELETE", f"{base}/namespaces/{ns}", None, 404),
    ]
    tried = {}
    for method, url, body, without_key in steps:
        headers = {**auth, KEY: str(uuid6.uuid7())}
        first = requests.request(method, url, json=body, headers=headers, timeout=60)
        assert first.status_code in (200, 204), (method, url, first.text)
        again = requests.request(method, url, json=body, headers=headers, timeout=60)
        assert (again.status_code, again.content) == (first.status_code, first.content), (method, url, again.text)
        assert again.headers.get("Idempotent-Replayed") == "true"
        if without_key is not None:  # the action happened once: without the key it is refused now
            assert requests.request(method, url, json=body, headers=auth, timeout=60).status_code == without_key
        tried[f"{method} {url.removeprefix(base)}"] = first.status_code
    assert len(tried) == len(steps)
    assert lake.catalog.load_table(f"{lake.namespace}.registered").metadata_location == made.metadata_location


def test_attempts_in_flight_at_once_with_one_key_act_once(lake, server):
    """Eight attempts with one key at the same moment (a client retrying while the first is in
    flight): one acts, the others get its answer; the table is created once."""
    import threading

    jid, secret = tokens.create(lake.conn, job=f"{lake.namespace}_solo", whole_lake=True)
    auth = {"Authorization": f"Bearer {access_token(server, jid, secret)}", KEY: str(uuid6.uuid7())}
    schema = {"type": "struct", "schema-id": 0, "fields": [{"id": 1, "name": "id", "type": "long", "required": False}]}
    url = f"{server}/v1/latest/namespaces/{lake.namespace}/tables"
    go, answers = threading.Barrier(8), []

    def attempt() -> None:
        go.wait()
        answers.append(requests.post(url, json={"name": "once", "schema": schema}, headers=auth, timeout=60))

    threads = [threading.Thread(target=attempt) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {(a.status_code, a.content) for a in answers} == {(200, answers[0].content)}, [a.text for a in answers]
    assert sum(a.headers.get("Idempotent-Replayed") == "true" for a in answers) == 7
    assert lake.catalog.load_table(f"{lake.namespace}.once").metadata_location == answers[0].json()["metadata-location"]


def test_keys_past_their_lifetime_are_purged_and_the_key_then_acts_as_new(lake, server):
    """A key is kept for its advertised lifetime (and a grace period); past it, records delete
    it (one in PURGE_EVERY; here purge() is called directly) and the same key acts anew."""
    Pipeline(lake, {"solo": ["facts"]}).advance()
    jid, secret = tokens.create(lake.conn, job=f"{lake.namespace}_solo", whole_lake=True)
    auth = {"Authorization": f"Bearer {access_token(server, jid, secret)}", "Content-Type": "application/json"}
    path, key = f"{server}/v1/latest/namespaces", str(uuid6.uuid7())
    body = json.dumps({"namespace": [f"{lake.namespace}_kept"]})
    first = requests.post(path, data=body, headers={**auth, KEY: key}, timeout=30)
    assert first.status_code == 200, first.text
    requests.delete(f"{path}/{lake.namespace}_kept", headers=auth, timeout=30).raise_for_status()
    replayed = requests.post(path, data=body, headers={**auth, KEY: key}, timeout=30)
    assert replayed.headers.get("Idempotent-Replayed") == "true" and replayed.content == first.content
    assert idempotency.purge(lake.conn) == 0  # within its lifetime
    lake.conn.execute("UPDATE idempotency_key SET expires_at = now() - interval '1 second' WHERE key = %s", (key,))
    assert idempotency.purge(lake.conn) == 1
    again = requests.post(path, data=body, headers={**auth, KEY: key}, timeout=30)
    assert again.status_code == 200 and "Idempotent-Replayed" not in again.headers  # it acted: created again
