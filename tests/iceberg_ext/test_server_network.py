"""The catalog server on a network: one names rule at every entry, health without a token,
bounded request bodies (a real `icebarrier serve` process and real HTTP clients)."""

from __future__ import annotations

import json
import time

import psutil
import requests
from click.testing import CliRunner

from icebarrier.apps.catalog.health import StorageProbe
from icebarrier.cli.main import cli as command
from icebarrier.control_plane import tokens
from icebarrier.iceberg_ext.config import Settings
from tests.iceberg_ext.catalog_server import access_token, free_port, start_server, stop_server
from tests.iceberg_ext.test_catalog_conformance import _job_token

RULE = "a name is 1 to 128 characters, not blank, not '.' or '..', without '/' or control characters"


def _writer(lake, server: str) -> dict:
    """A job's token (a job may change the catalog: create namespaces and unmanaged tables)."""
    cid, secret = _job_token(lake).split(":")
    return {"Authorization": f"Bearer {access_token(server, cid, secret)}"}


def test_one_names_rule_for_namespaces_and_tables(lake, server):
    """Levels that are dots, hold a control character or are too long, and such table names (or
    with '/'), are refused with a 400 naming the rule; nothing is created. A '.' inside a name is
    served, as are Unicode names within the rule."""
    headers = _writer(lake, server)
    base = f"{server}/v1/latest/namespaces"
    for levels in ([".", "."], [".."], ["."], ["a\nb"], ["x" * 129], ["y" * 100, "z" * 100, "w" * 100], []):
        r = requests.post(base, json={"namespace": levels}, headers=headers, timeout=30)
        assert r.status_code == 400, (levels, r.status_code, r.text)
        message = r.json()["error"]["message"]
        assert RULE in message or "at most 255 characters" in message or "at least one level" in message, message
    listed = requests.get(base, headers=headers, timeout=30).json()["namespaces"]
    assert not [n for n in listed if any(level in (".", "..") or not level.strip() for level in n)], listed
    ok = requests.post(base, json={"namespace": ["ünï_côdé"]}, headers=headers, timeout=30)
    assert ok.status_code == 200, ok.text
    schema = {"type": "struct", "schema-id": 0, "fields": [{"id": 1, "name": "n", "type": "long", "required": False}]}
    for name in (".", "..", "a/b", "tab\there"):
        r = requests.post(f"{base}/ünï_côdé/tables", json={"name": name, "schema": schema}, headers=headers, timeout=30)
        assert r.status_code == 400 and RULE in r.json()["error"]["message"], (name, r.text)
    assert requests.get(f"{base}/ünï_côdé/tables", headers=headers, timeout=30).json()["identifiers"] == []
    r = requests.get(f"{server}/v1/latest/namespaces/..%1F..", headers=headers, timeout=30)
    assert r.status_code == 400 and RULE in r.json()["error"]["message"], r.text


def test_doctor_lists_names_earlier_versions_let_through(lake):
    """A namespace and a table an earlier version created against the rule (a blank level, a
    '/', a '%' icebarrier would not store) are listed by `icebarrier doctor`, which exits 1; a
    lake that keeps the rule passes."""
    clean = CliRunner().invoke(command, ["--output", "json", "doctor"])
    assert clean.exit_code == 0 and json.loads(clean.stdout) == [], clean.output
    lake.catalog.create_namespace(("..",))  # PyIceberg's SQL catalog stores it, as earlier servers did
    lake.catalog.create_namespace(("50%",))
    lake.catalog.create_table((lake.namespace, "a/b"), schema=_schema())
    out = CliRunner().invoke(command, ["--output", "json", "doctor"])
    assert out.exit_code == 1, out.output
    found = {(f["kind"], f["name"]) for f in json.loads(out.stdout)}
    assert found == {("namespace", ".."), ("namespace", "50%"), ("table", f"{lake.namespace}.a/b")}, found
    lake.catalog.drop_table((lake.namespace, "a/b"))
    lake.catalog.drop_namespace(("..",))
    lake.catalog.drop_namespace(("50%",))


def _schema():
    import pyarrow as pa

    return pa.schema([pa.field("n", pa.int64())])


def test_health_answers_without_a_token_and_reveals_nothing(lake, server):
    """/healthz and /readyz answer 200 without a token, with a status and nothing else."""
    alive = requests.get(f"{server}/healthz", timeout=30)
    assert alive.status_code == 200 and alive.json() == {"status": "alive"}
    ready = requests.get(f"{server}/readyz", timeout=30)
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    assert requests.get(f"{server}/v1/latest/namespaces", timeout=30).status_code == 401  # the rest needs one


def test_readiness_fails_on_a_warehouse_it_cannot_write(tmp_path):
    """The storage probe says not ready for a warehouse folder that is missing or read-only."""
    missing = Settings(dsn="postgresql://unused", warehouse=str(tmp_path / "nowhere"))
    assert not StorageProbe().ok(missing)
    (tmp_path / "ro").mkdir(mode=0o500)
    read_only = Settings(dsn="postgresql://unused", warehouse=str(tmp_path / "ro"))
    assert StorageProbe().ok(read_only) is _root()  # root may write a read-only folder
    assert StorageProbe().ok(Settings(dsn="postgresql://unused", warehouse=str(tmp_path)))


def test_serve_makes_a_missing_local_warehouse_and_refuses_one_it_cannot(lake, tmp_path):
    """`serve` on a local warehouse folder that does not exist yet makes it (``/readyz`` said 503
    "storage" until something else did); one it cannot make is refused in one line at start."""
    import os
    import subprocess

    fresh = tmp_path / "new" / "warehouse"
    proc, uri = start_server(lake, env_extra={"ICEBARRIER_WAREHOUSE": str(fresh)})
    try:
        assert fresh.is_dir()
        ready = requests.get(f"{uri}/readyz", timeout=30)
        assert ready.status_code == 200, ready.text
    finally:
        stop_server(proc)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    env = {**os.environ, "ICEBARRIER_SCHEMA": lake.settings.schema, "ICEBARRIER_WAREHOUSE": str(blocker / "wh")}
    done = subprocess.run(
        ["icebarrier", "serve", "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=120
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert "a-file/wh: its folder cannot be created" in lines[0], lines


def _declared_upload(server: str, megabytes: int) -> tuple[int, int]:
    """POST a body of ``megabytes`` declared by Content-Length, a megabyte at a time, reading the
    answer as soon as one comes: (status, megabytes sent by then)."""
    import select
    import socket
    from urllib.parse import urlparse

    url = urlparse(server)
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        s.sendall(
            f"POST /v1/latest/namespaces HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {megabytes << 20}\r\n\r\n".encode()
        )
        sent = 0
        while sent < megabytes and not select.select([s], [], [], 0)[0]:
            try:
                s.sendall(b"x" * (1 << 20))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
        answer = s.recv(4096).decode(errors="replace")
    return int(answer.split(" ", 2)[1]), sent


def _root() -> bool:
    import os

    return os.geteuid() == 0  # root writes a read-only folder anyway


def test_a_body_past_the_limit_is_refused_before_it_is_read(lake):
    """With --max-body 1MB: a 200 MB body declared by Content-Length is refused with 413 at
    once, without a token and before the server reads it (its memory does not grow); a chunked
    body is refused as soon as it passes the limit; the token request has its own, smaller limit;
    a body within the limit is served."""
    proc, server = start_server(lake, "--max-body", "1MB")
    try:
        rss_before = psutil.Process(proc.pid).memory_info().rss
        status, sent_mb = _declared_upload(server, 200)  # 200 MB declared, no token
        assert status == 413, status
        assert sent_mb < 200, "the server read the whole body before answering"
        growth = psutil.Process(proc.pid).memory_info().rss - rss_before
        assert growth < 50 << 20, f"the server grew by {growth >> 20} MB"

        def chunked():
            for _ in range(3):
                yield b"y" * (600 << 10)

        headers = _writer(lake, server)
        r = requests.post(f"{server}/v1/latest/namespaces", data=chunked(), headers=headers, timeout=60)
        assert r.status_code == 413, r.text
        r = requests.post(f"{server}/v1/oauth/tokens", data={"client_id": "x" * (100 << 10)}, timeout=30)
        assert r.status_code == 413, r.text
        r = requests.post(
            f"{server}/v1/latest/namespaces", json={"namespace": ["small_enough"]}, headers=headers, timeout=30
        )
        assert r.status_code == 200, r.text
    finally:
        stop_server(proc)


def test_json_access_log_has_request_ids_and_no_secret(lake):
    """With --log-format json: one JSON line per request with its id (the client's, or a new one
    the answer carries back), the principal, the route's template, status and duration; neither
    the client secret nor the access token appears anywhere in the server's output."""
    cid, secret = _job_token(lake).split(":")
    proc, server = start_server(lake, "--log-format", "json")
    try:
        token = access_token(server, cid, secret)
        headers = {"Authorization": f"Bearer {token}"}
        mine = requests.get(
            f"{server}/v1/latest/namespaces", headers={**headers, "X-Request-Id": "trace-42"}, timeout=30
        )
        assert mine.status_code == 200 and mine.headers["X-Request-Id"] == "trace-42"
        odd = requests.get(
            f"{server}/v1/latest/namespaces", headers={**headers, "X-Request-Id": "bad id\t"}, timeout=30
        )
        assert odd.headers["X-Request-Id"] != "bad id\t" and len(odd.headers["X-Request-Id"]) == 16
        missing = requests.get(
            f"{server}/v1/latest/namespaces/{lake.namespace}/tables/nope", headers=headers, timeout=30
        )
        assert missing.status_code == 404
        anonymous = requests.get(f"{server}/v1/latest/namespaces?token={secret}", timeout=30)
        assert anonymous.status_code == 401
    finally:
        output = stop_server(proc)
    assert secret not in output and token not in output, output[-2000:]
    lines = [json.loads(x) for x in output.splitlines() if x.startswith("{")]
    by_id = {x["request_id"]: x for x in lines}
    assert by_id["trace-42"]["route"] == "/v1/{prefix}/namespaces" and by_id["trace-42"]["status"] == 200
    assert by_id["trace-42"]["principal"] == f"job:{cid}" and by_id["trace-42"]["duration_ms"] >= 0
    assert by_id[missing.headers["X-Request-Id"]]["route"] == "/v1/{prefix}/namespaces/{namespace}/tables/{table}"
    assert by_id[missing.headers["X-Request-Id"]]["status"] == 404
    assert by_id[anonymous.headers["X-Request-Id"]]["status"] == 401
    assert any(x["route"] == "/v1/oauth/tokens" and x["status"] == 200 for x in lines), lines


def _hanging(
    server: str,
    headers: dict[str, str],
    *,
    sent: bytes = b"{",
    declared: int = 100,
    path: str = "/v1/latest/namespaces",
    content_type: str = "application/json",
):
    """A request whose declared body never comes whole (``sent`` of ``declared`` bytes): in
    flight until the server gives up on it, or the socket is closed."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(server)
    s = socket.create_connection((url.hostname, url.port), timeout=30)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {declared}\r\n{extra}\r\n".encode()
        + sent
    )
    return s


def test_bodies_in_memory_are_bounded_and_a_body_without_a_token_is_not_read(lake):
    """With --max-body-memory 1MB: a request holding 700 KB of an unfinished body leaves no room
    for another 500 KB body, answered 503 with Retry-After; once the first ends, the second is
    taken. A body sent without a token is answered 401 at once, unread."""
    proc, server = start_server(lake, "--max-body-memory", "1MB")
    try:
        token = _writer(lake, server)
        holding = _hanging(server, token, sent=b" " * (700 << 10), declared=900 << 10)
        headers = {**token, "Content-Type": "application/json"}
        time.sleep(0.5)
        body = b" " * (500 << 10) + b'{"namespace": ["after_the_wait"]}'
        busy = requests.post(f"{server}/v1/latest/namespaces", data=body, headers=headers, timeout=30)
        assert busy.status_code == 503 and busy.headers["Retry-After"] == "1", busy.text
        assert "--max-body-memory" in busy.json()["error"]["message"]
        holding.close()
        deadline = time.monotonic() + 30
        while (
            r := requests.post(f"{server}/v1/latest/namespaces", data=body, headers=headers, timeout=30)
        ).status_code == 503:
            assert time.monotonic() < deadline, "the first body was never let go"
            time.sleep(0.1)
        assert r.status_code == 200, r.text

        def endless():
            while True:
                yield b"z" * (1 << 20)

        anonymous = requests.post(f"{server}/v1/latest/namespaces", data=endless(), timeout=30)
        assert anonymous.status_code == 401, anonymous.text
    finally:
        stop_server(proc)


def test_per_token_requests_in_flight_and_slow_bodies_are_bounded(lake):
    """With --max-per-token 2 --body-timeout 2s: two requests of one token whose bodies never
    come hold its two places, a third is answered 429 with Retry-After at once (another token is
    served meanwhile); the two slow ones are answered 408 when their time is up, and the token is
    served again."""
    cid, secret = _job_token(lake).split(":")
    proc, server = start_server(lake, "--max-per-token", "2", "--body-timeout", "2s")
    try:
        headers = {"Authorization": f"Bearer {access_token(server, cid, secret)}"}
        slow = [_hanging(server, headers) for _ in range(2)]
        time.sleep(0.3)
        third = requests.get(f"{server}/v1/latest/namespaces", headers=headers, timeout=30)
        assert third.status_code == 429 and third.headers["Retry-After"] == "1", third.text
        cid2, secret2 = tokens.create(lake.conn, job=f"{lake.namespace}_conformance", whole_lake=True)
        other = requests.get(
            f"{server}/v1/latest/namespaces",
            headers={"Authorization": f"Bearer {access_token(server, cid2, secret2)}"},
            timeout=30,
        )
        assert other.status_code == 200, other.text
        for s in slow:
            answer = s.recv(4096).decode(errors="replace")
            assert answer.startswith("HTTP/1.1 408"), answer
            s.close()
        again = requests.get(f"{server}/v1/latest/namespaces", headers=headers, timeout=30)
        assert again.status_code == 200, again.text
    finally:
        stop_server(proc)


def test_a_token_request_refused_for_a_while_is_sent_again(lake):
    """With --max-per-token 1 --body-timeout 2s, a token request from this address whose body never
    comes holds the address's one place (requests without a token count per address). `job exec`'s
    client, taking its token for a request, is refused with 429 and asks again, within the
    request's retries, until the place is free (the slow one answered 408), then the request is
    answered. (Broken on purpose, the token taken outside the request's retries, the 429 was the
    answer: a publish that needed a new token on a busy server failed its barrier.)"""
    from icebarrier.apps.job_exec import SessionClient

    credential = _job_token(lake)
    proc, server = start_server(lake, "--max-per-token", "1", "--body-timeout", "2s")
    try:
        slow = _hanging(server, {}, path="/v1/oauth/tokens", content_type="application/x-www-form-urlencoded")
        time.sleep(0.3)
        refused = requests.post(f"{server}/v1/oauth/tokens", data={"grant_type": "client_credentials"}, timeout=30)
        assert refused.status_code == 429, refused.text  # the place is taken
        answer = SessionClient(server, credential).call("GET", f"{lake.namespace}_conformance")
        assert answer == {"session": None}, answer
        assert slow.recv(4096).decode(errors="replace").startswith("HTTP/1.1 408")
        slow.close()
    finally:
        stop_server(proc)


def test_serve_https_with_a_certificate_clients_verify(lake, tmp_path, monkeypatch):
    """`serve --tls-cert/--tls-key`: PyIceberg (its `ssl.cabundle`, and REQUESTS_CA_BUNDLE for its
    OAuth2 token request) and requests load and commit over https, verifying the server against
    the CA; plain http on the port is refused, and a client that does not trust the CA fails
    instead of sending its credential. One of the two flags alone is a usage error."""
    import trustme
    from pyiceberg.catalog.rest import RestCatalog

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    pem = str(tmp_path / "server.pem")
    half = CliRunner().invoke(command, ["serve", "--tls-cert", pem])
    assert half.exit_code == 2 and "--tls-cert and --tls-key go together" in half.output
    credential = _job_token(lake)
    proc, plain = start_server(lake, "--tls-cert", pem, "--tls-key", pem)
    server = plain.replace("http://", "https://")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "ca.pem"))
    try:
        catalog = RestCatalog(
            "tls",
            uri=server,
            warehouse="latest",
            credential=credential,
            **{"oauth2-server-uri": f"{server}/v1/oauth/tokens", "ssl": {"cabundle": str(tmp_path / "ca.pem")}},
        )
        catalog.create_namespace(("over_tls",))
        table = catalog.create_table(("over_tls", "t"), schema=_schema())
        import pyarrow as pa

        table.append(pa.table({"n": [1, 2, 3]}, schema=_schema()))
        assert catalog.load_table(("over_tls", "t")).scan().to_arrow().num_rows == 3
        assert requests.get(f"{server}/healthz", verify=str(tmp_path / "ca.pem"), timeout=30).status_code == 200
        untrusting = requests.Session()
        untrusting.trust_env = False  # the system's CAs, which do not know ours
        try:
            untrusting.get(f"{server}/healthz", timeout=30)
            raise AssertionError("a client that does not trust the CA was served")
        except requests.exceptions.SSLError:
            pass
        with requests.Session() as http:
            try:
                answer = http.get(f"{plain}/healthz", timeout=5)
                raise AssertionError(f"plain http was served: {answer.status_code}")
            except (requests.ConnectionError, requests.Timeout):
                pass  # no TLS handshake: the server answers nothing
        catalog._session.close()  # else its idle TLS connection holds the server's shutdown to the grace
    finally:
        stop_server(proc)
